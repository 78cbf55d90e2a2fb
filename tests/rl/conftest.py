"""Fixtures shared by the tests of rl/."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import ray


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module's tests (2 logical CPUs, no dashboard)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def train_two_grpo_steps(model_dir, out) -> list[dict]:
    """``python -m jointrl.rl.train model=hf model.path=<model_dir>`` for two GRPO steps of 2 prompts x 2
    samples (32 tokens a turn, the default env, a subprocess as a user runs it); fails with the run's
    output when it does not exit 0; returns both steps' trajectories (their JSON)."""
    cmd = [sys.executable, "-m", "jointrl.rl.train", "model=hf", f"model.path={model_dir}", f"output_dir={out}",
           "algo.total_steps=2", "algo.prompts_per_step=2", "algo.group_size=2", "checkpoint_every=0",
           "envs.num_workers=1", "rollout.max_tokens_per_turn=32", "algo.max_refill_attempts=0",
           "logger.wandb_mode=disabled"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    files = sorted((out / "trajectories").glob("step_*.jsonl"))
    assert len(files) == 2
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def learner_and_engine(cfg, port: int, block_size: int = 4):
    """A rank-0 ``LearnerWorker`` of ``cfg`` (its process group on ``port``) and an ``LLMEngine`` over
    ``cfg``'s model holding the learner's weights (version 1)."""
    # lazy: DeepSpeed and the engine load only for the tests that build them, not for every rl test
    from jointrl.rl.build import build_model, build_tokenizer  # lazy: as above
    from jointrl.rl.learner.worker import LearnerWorker  # lazy: as above
    from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine  # lazy: as above

    lw = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    engine = LLMEngine(build_model(cfg), build_tokenizer(cfg), EngineConfig(num_blocks=64, block_size=block_size,
                                                                            max_num_seqs=4))
    engine.update_weights(1, lw.weight_bundle(1))
    return lw, engine


def assert_learner_logprobs_match(lw, prompts, outs, abs_tol: float = 1e-10) -> int:
    """Every sampled token of ``outs`` (the engine's turns after ``prompts``) has the learner's log-prob
    of it within ``abs_tol`` of the engine's; returns how many were checked (forced tokens are not)."""
    learner_lp = lw.logprobs([p + o.token_ids for p, o in zip(prompts, outs)])
    checked = 0
    for p, o, lp in zip(prompts, outs, learner_lp):
        for i, (tok_lp, sampled) in enumerate(zip(o.logprobs, o.sampled)):
            if sampled:
                assert lp[len(p) + i] == pytest.approx(tok_lp, abs=abs_tol)
                checked += 1
    return checked


def serve_tool_conversation(model_dir, record, tool_output: str, reasoning: str | None = None, *overrides: str) -> str:
    """``jointrl serve model=hf model.path=<model_dir>`` (port 0, recording to ``record``, plus ``overrides``)
    asked through the real ``openai`` client for a first reply, then, after an assistant tool call
    ``run {"command": "ls"}`` written by the client (with ``reasoning`` as its ``reasoning_content``) and the
    tool's ``tool_output``, for a second; both must finish normally. Stops the server; returns the
    conversation id."""
    import openai

    proc = subprocess.Popen([sys.executable, "-c", "from jointrl.rl.cli import main; main()", "serve", "model=hf",
                             f"model.path={model_dir}", "serve.port=0", f"serve.record_path={record}", *overrides,
                             "rollout.quantize_experts=false", "serve.default_max_tokens=16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = ""
        for line in proc.stdout:
            if "listening on" in line:
                break
        assert "listening on" in line, f"server did not start: {line!r}"
        client = openai.OpenAI(base_url=f"{line.split('listening on ')[1].split()[0]}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        tools = [{"type": "function", "function": {"name": "run", "description": "run a command", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the files."}]
        first = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=12, seed=1)
        assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
        call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": json.dumps({"command": "ls"})}}
        msgs += [{"role": "assistant", "content": "", **({"reasoning_content": reasoning} if reasoning else {}),
                  "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": tool_output}]
        second = client.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=12, seed=2)
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return second.model_extra["conversation_id"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="session")
def hf_run():
    """The checks of a run started from a Hugging Face directory, the same for every architecture
    (tests/rl/test_*_run.py, test_hf_model.py): ``hf_run.train_two_grpo_steps``, ``.learner_and_engine``,
    ``.assert_learner_logprobs_match``, ``.serve_tool_conversation``."""
    return SimpleNamespace(train_two_grpo_steps=train_two_grpo_steps, learner_and_engine=learner_and_engine,
                           assert_learner_logprobs_match=assert_learner_logprobs_match,
                           serve_tool_conversation=serve_tool_conversation)
