from jointrl.rl.losses.common import Aggregation, KLEstimator, LossInputs, Regularizers
from jointrl.rl.losses.grpo import GRPOLoss
from jointrl.rl.losses.gspo import GSPOLoss
from jointrl.rl.losses.mismatch import MismatchCorrection, MismatchMode
from jointrl.rl.losses.ppo import PPOLoss
from jointrl.rl.losses.sft import SFTLoss

__all__ = ["Aggregation", "GRPOLoss", "GSPOLoss", "KLEstimator", "LossInputs", "MismatchCorrection", "MismatchMode",
           "PPOLoss", "Regularizers", "SFTLoss"]
