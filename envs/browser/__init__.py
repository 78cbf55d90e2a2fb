"""The browser domain: question answering and web tasks over local sites (see ``env.py``).

``web/`` is what runs inside the sandbox (sites, page driver, browsers); ``env.py`` the
host's ``Env``; ``tasks.py`` the task generator and scripted policies. Nothing is imported
here, so that the sandbox can run ``web`` standalone.
"""
