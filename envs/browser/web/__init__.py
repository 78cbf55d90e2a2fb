"""What runs inside the episode's sandbox: the sites, the page driver and its two browsers.

Stdlib and relative imports only (plus the tool venv's markdownify / Playwright, imported where
used): the sandbox mounts this folder read-only and runs ``python -m web.driver`` from its
parent. The host imports the same modules (``jointrl.envs.browser.web``) to plan oracle
policies against in-process sites.
"""
