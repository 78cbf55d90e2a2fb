"""Run tracking: Weights & Biases (offline by default), one console line per step, and the
step's trajectories as JSONL and parquet (``<output_dir>/trajectories/step_000001.{jsonl,parquet}``).

wandb gets the resolved config (``wandb.init(config=...)``), every per-step scalar, histograms
(``staleness/histogram``) and a ``trajectories`` table of ``logger.table_rows`` transcripts
per step (evenly spaced over the step's trajectories: domain, task, tier, reward, finish
reason, turns, the decoded tokens with special tokens shown). Tested by reading the offline
run directory (``tests/rl/test_tracking.py``).

Beside each JSONL shard the same trajectories go to ``step_000001.parquet`` (:func:`write_parquet`),
one row per trajectory with the JSONL's fields, so ``datasets.load_dataset("parquet", ...)`` and
``pandas.read_parquet`` read a run without a loader of ours. Per-token fields are list columns
(``token_ids``/``policy_version`` int64, ``loss_mask`` int8, ``logprobs`` float64: the JSONL's
values exactly); ``routed_experts`` keeps the JSONL's compact encoding, a struct
``{dtype, shape, data}`` (``rl/types.tensor_from_json`` reads a row's value back);
``messages`` and ``reward_info`` are free-form (tool arguments, reward parts), so they are JSON
text columns (``json.loads`` gives the JSONL's value)."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jointrl.rl.build import build_tokenizer
from jointrl.rl.config import Config
from jointrl.rl.types import Trajectory

_JSON_TEXT = ("messages", "reward_info")  # free-form nested values: JSON text in the parquet shard
PARQUET_SCHEMA = pa.schema([
    ("token_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float64())),
    ("policy_version", pa.list_(pa.int64())), ("domain", pa.string()), ("task_id", pa.string()),
    ("group_id", pa.string()), ("tier", pa.string()), ("finish_reason", pa.string()), ("reward", pa.float64()),
    ("reward_info", pa.string()), ("messages", pa.string()), ("num_turns", pa.int64()),
    ("num_tool_calls", pa.int64()), ("num_tool_errors", pa.int64()), ("env_retries", pa.int64()),
    ("reward_time_s", pa.float64()), ("think_tokens", pa.int64()),
    ("routed_experts", pa.struct([("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.string())])),
    ("image_patches", pa.list_(pa.int64())),
])


def write_parquet(path: Path, rows: list[dict]) -> None:
    """Write ``Trajectory.to_json()`` rows as one parquet file of ``PARQUET_SCHEMA``."""
    assert not rows or set(rows[0]) == set(PARQUET_SCHEMA.names), "PARQUET_SCHEMA out of step with Trajectory"
    cols = {name: [json.dumps(r[name]) if name in _JSON_TEXT else r[name] for r in rows]
            for name in PARQUET_SCHEMA.names}
    pq.write_table(pa.table(cols, schema=PARQUET_SCHEMA), path)


class RunTracker:
    def __init__(self, cfg: Config, out_dir: Path) -> None:
        self.cfg, self.out_dir = cfg, out_dir
        self.traj_dir = out_dir / "trajectories"
        self.traj_dir.mkdir(parents=True, exist_ok=True)
        self.run = None
        self.tok = build_tokenizer(cfg)
        if cfg.logger.wandb_mode != "disabled":
            import wandb

            id_file = out_dir / "wandb_run_id"  # a resumed run continues the same wandb run
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=cfg.logger.project, name=cfg.run_name, id=run_id, resume="allow",
                                  dir=str(out_dir), mode=cfg.logger.wandb_mode, config=asdict(cfg))

    def log(self, step: int, metrics: dict[str, float], trajs: list[Trajectory],
            histograms: dict[str, list[float]] | None = None) -> None:
        if self.run is not None:
            import wandb

            payload: dict = dict(metrics)
            payload.update({k: wandb.Histogram(v) for k, v in (histograms or {}).items() if v})
            if self.cfg.logger.table_rows and trajs:
                payload["trajectories"] = self._table(step, trajs)
            self.run.log(payload, step=step)
        if self.cfg.logger.dump_trajectories:
            rows = [t.to_json() for t in trajs]
            with open(self.traj_dir / f"step_{step:06d}.jsonl", "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
            write_parquet(self.traj_dir / f"step_{step:06d}.parquet", rows)
        m = metrics
        print(f"step {step:4d} | reward {m['reward/mean']:.3f} | tool_err {m['tool_error_rate']:.2f} "
              f"| env_err {int(m['env_error'])} | tok/s {m['perf/rollout_tokens_per_s']:.0f} "
              f"| rollout {m['time/rollout_s']:.1f}s reward {m['time/reward_s']:.1f}s "
              f"learner {m['time/learner_s']:.1f}s push {m['time/push_s']:.1f}s | loss {m.get('learner/loss', 0.0):+.4f}",
              flush=True)

    def _table(self, step: int, trajs: list[Trajectory]):
        import wandb

        n = min(self.cfg.logger.table_rows, len(trajs))
        picked = [trajs[i * len(trajs) // n] for i in range(n)]
        table = wandb.Table(columns=["step", "domain", "task_id", "group_id", "tier", "reward", "finish_reason",
                                     "turns", "tool_calls", "transcript"])
        for t in picked:
            table.add_data(step, t.domain, t.task_id, t.group_id, t.tier, float(t.reward), str(t.finish_reason),
                           t.num_turns, t.num_tool_calls, self.tok.decode(t.token_ids))
        return table

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
