"""jointrl: joint RL post-training of Mixture-of-Experts language models as long-horizon agents.

The repository's top-level folders install as subpackages of this one package:
``jointrl.rl``, ``jointrl.model``, ``jointrl.kernels``, ``jointrl.envs``, ``jointrl.rewards``
(see docs/architecture.md).
"""

__version__ = "0.1.0"
