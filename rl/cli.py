"""The ``jointrl`` console script: ``jointrl <command> [hydra overrides]``."""

from __future__ import annotations

import sys

COMMANDS = ("train", "serve", "export", "eval", "sft", "recipe")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        got = sys.argv[1] if len(sys.argv) > 1 else "nothing"
        sys.exit(f"usage: jointrl {{{'|'.join(COMMANDS)}}} [key=value ...]; got {got!r}")
    command = sys.argv.pop(1)
    from jointrl.rl.preflight import guard  # config and task folders checked before Ray: one line, exit 2

    sys.argv[1:] = guard(command, sys.argv[1:])
    if command == "train":
        from jointrl.rl.train import main as train_main  # lazy: only the chosen command's modules load

        train_main()
    elif command == "serve":
        from jointrl.rl.rollout.server import main as serve_main  # lazy: only the chosen command's modules load

        serve_main()
    elif command == "export":
        from jointrl.rl.export import main as export_main  # lazy: only the chosen command's modules load

        export_main()
    elif command == "eval":
        from jointrl.rl.eval import main as eval_main  # lazy: only the chosen command's modules load

        eval_main()
    elif command == "sft":
        from jointrl.rl.sft import main as sft_main  # lazy: only the chosen command's modules load

        sft_main()
    elif command == "recipe":
        from jointrl.rl.recipe import main as recipe_main  # lazy: only the chosen command's modules load

        recipe_main()


if __name__ == "__main__":
    main()
