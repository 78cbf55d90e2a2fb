from jointrl.rl.losses.grpo import GRPOLoss

__all__ = ["GRPOLoss"]
