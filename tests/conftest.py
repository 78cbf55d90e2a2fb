import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_SILENT", "true")
