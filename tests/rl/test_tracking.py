"""wandb offline: what a run logs, read back from the offline run directory (config, per-step
scalars and histogram from the transaction log, the trajectory table's JSON)."""

import json

from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.config import load_config
from jointrl.rl.tracking import RunTracker
from jointrl.rl.types import Trajectory


def _log_records(path) -> list[bytes]:
    """The records of a ``.wandb`` transaction log: LevelDB's log format (32 KiB blocks of chunks,
    each ``crc32c(4) length(2) type(1) data``; 1 full, 2 first, 3 middle, 4 last) after a 7-byte
    ``:W&B`` header. The SDK no longer ships a reader."""
    raw, pos, out, parts = path.read_bytes(), 7, [], b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            out.append(parts)
    return out


def _records(run_dir, kind: str) -> list[dict]:
    """The ``kind`` records (``history``, ``config``: also the run record's) of the run's transaction log."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("*.wandb")
    rows = []
    for data in _log_records(log):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        got = rec.WhichOneof("record_type")
        if got == kind or (kind, got) == ("config", "run"):  # the run record carries the initial config
            items = {"history": lambda: rec.history.item, "config": lambda: rec.config.update,
                     "run": lambda: rec.run.config.update}[got]()
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})
    return rows


def _traj(i: int, reward: float) -> Trajectory:
    ids = ChatTemplate().render([]) + list(b"plan") + [260] + list(f"answer {i}".encode()) + [258]
    mask = [0] * (len(ids) - 14) + [1] * 14
    return Trajectory(ids, mask, [0.0] * len(ids), [0] * len(ids), "terminal", f"task{i}", f"s1-g{i // 2}", tier="low",
                      reward=reward)


def test_offline_run_holds_config_scalars_histogram_and_trajectory_table(tmp_path):
    cfg = load_config([f"output_dir={tmp_path}", "logger.table_rows=2", "run_name=tracked", "rollout.mode=async"])
    tracker = RunTracker(cfg, tmp_path)
    metrics = {"reward/mean": 0.5, "tool_error_rate": 0.0, "env_error": 0, "perf/rollout_tokens_per_s": 100.0,
               "time/rollout_s": 1.0, "time/reward_s": 0.1, "time/learner_s": 2.0, "time/push_s": 0.2,
               "weight_sync/apply_s": 0.05, "staleness/mean": 0.5, "thinking_tokens/low": 4.0}
    trajs = [_traj(i, r) for i, r in enumerate([1.0, 0.0, 0.25, 0.75])]
    tracker.log(1, metrics, trajs, histograms={"staleness/histogram": [0, 1, 1, 0]})
    tracker.finish()
    import wandb

    wandb.teardown()  # the service writes the transaction log; shutting it down flushes it

    (run,) = tmp_path.glob("wandb/offline-run-*")
    config = {k: v for r in _records(run, "config") for k, v in r.items()}  # the resolved config
    assert config["rollout"]["mode"] == "async" and config["run_name"] == "tracked"
    assert config["logger"]["table_rows"] == 2 and config["rollout"]["weight_transport"] == "ray"
    (row,) = [r for r in _records(run, "history") if "reward/mean" in r]
    assert row["reward/mean"] == 0.5 and row["weight_sync/apply_s"] == 0.05 and row["thinking_tokens/low"] == 4.0
    assert row["staleness/histogram/_type"] == "histogram" and sum(row["staleness/histogram/values"]) == 4
    assert row["trajectories/_type"] == "table-file" and row["trajectories/nrows"] == 2
    (table_file,) = (run / "files" / "media" / "table").glob("trajectories_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][-1] == "transcript" and len(table["data"]) == 2
    first, second = table["data"]
    assert first[2] == "task0" and first[5] == 1.0 and second[2] == "task2" and second[5] == 0.25  # evenly spaced
    assert "<|im_start|>assistant\n<think>plan</think>answer 0<|im_end|>" in first[-1]


def test_parquet_shard_loads_with_datasets_and_pandas_as_the_jsonl(tmp_path):
    """A real episode (engine routes recorded, a tool-call-free transcript) and scripted ones,
    dumped by ``RunTracker.log``: the parquet shard read by ``datasets`` and by pandas holds the
    JSONL's token ids, masks, log-probs, rewards, routes (same encoding) and transcripts."""
    import asyncio

    import datasets
    import pandas as pd
    import torch

    from jointrl.envs.base import Message, Task
    from jointrl.model import MoEConfig, MoETransformer
    from jointrl.rl.agent_loop import AgentConfig, run_episode
    from jointrl.rl.rollout.llm_engine import EngineConfig, LLMEngine
    from jointrl.rl.types import SamplingParams, tensor_from_json

    tpl = ChatTemplate()
    model = MoETransformer.from_config(MoEConfig(initializer_range=0.1), dtype=torch.float64, seed=4).eval()
    engine = LLMEngine(model, tpl.tok, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                    return_routed_experts=True))

    class QuietEnv:
        tools = []

        async def reset(self, task):
            return [Message(role="user", content=task.prompt)]

        async def close(self):
            pass

    async def go():
        try:
            return await run_episode(QuietEnv(), engine, Task(id="r", domain="r", prompt="Route me.", tier="low",
                                                              max_turns=1, reward={"format": 1.0}),
                                     tpl, SamplingParams(max_tokens=9, temperature=0),
                                     AgentConfig(max_context=512, thinking_budget={"low": 2}), group_id="g")
        finally:
            await engine.close()

    real = asyncio.run(go())
    real.reward, real.reward_info = 0.5, {"format": 0.5, "parts": {"x": [1, 2]}}
    trajs = [real, *(_traj(i, r) for i, r in enumerate([1.0, 0.0]))]
    cfg = load_config([f"output_dir={tmp_path}", "logger.wandb_mode=disabled"])
    metrics = {"reward/mean": 0.5, "tool_error_rate": 0.0, "env_error": 0, "perf/rollout_tokens_per_s": 1.0,
               "time/rollout_s": 1.0, "time/reward_s": 0.1, "time/learner_s": 2.0, "time/push_s": 0.2}
    RunTracker(cfg, tmp_path).log(7, metrics, trajs)

    jsonl = [json.loads(x) for x in (tmp_path / "trajectories" / "step_000007.jsonl").read_text().splitlines()]
    shard = str(tmp_path / "trajectories" / "step_000007.parquet")
    ds = datasets.load_dataset("parquet", data_files=shard, split="train", cache_dir=str(tmp_path / "hf"))
    df = pd.read_parquet(shard)
    assert len(ds) == len(df) == len(jsonl) == 3 and set(ds.column_names) == set(jsonl[0])
    for row, ref, (_, pdrow) in zip(ds, jsonl, df.iterrows()):
        for key in ("token_ids", "loss_mask", "logprobs", "policy_version", "reward", "task_id", "finish_reason"):
            assert row[key] == ref[key], key
        assert list(pdrow["token_ids"]) == ref["token_ids"] and list(pdrow["loss_mask"]) == ref["loss_mask"]
        assert pdrow["reward"] == ref["reward"]
        assert json.loads(row["messages"]) == ref["messages"] and json.loads(row["reward_info"]) == ref["reward_info"]
        assert row["routed_experts"] == ref["routed_experts"]
    routes = tensor_from_json(ds[0]["routed_experts"])
    assert routes.shape[0] == len(real.token_ids) and torch.equal(routes, real.routed_experts)
    assert ds[1]["routed_experts"] is None and 1 in ds[0]["loss_mask"] and 0 in ds[0]["loss_mask"]
