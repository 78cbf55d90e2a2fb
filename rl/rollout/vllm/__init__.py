"""``rollout.backend=vllm``: rollouts on vLLM, in its own venv and process (``engine.VLLMEngine``).

- ``engine.py``  the ``RolloutEngine`` over an engine process it starts, health-checks and restarts
- ``weights.py`` our state dict -> the checkpoint names vLLM loads (per-expert Qwen3-MoE)
- ``wire.py``    the message framing both interpreters share (standard library only)
- ``venv/serve.py`` the engine process itself: run by the vLLM venv's python, not a module of ours
"""
