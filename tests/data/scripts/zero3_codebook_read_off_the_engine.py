"""DeepSpeed ZeRO-3: a wav2vec 2.0-style quantizer's codebook, a parameter the
model declares, read straight off the engine's module to log its statistics
between steps. Outside the engine's forward each rank holds a torch.Size([0])
placeholder of it, so the view fails (numel 0); the read belongs inside
deepspeed.zero.GatheredParameters. Lint-only (DeepSpeed and a GPU)."""

import os

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

GROUPS, ENTRIES, DIM = 2, 320, 128
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}


class Quantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, GROUPS * ENTRIES)
        self.codevectors = nn.Parameter(torch.empty(GROUPS * ENTRIES, DIM // GROUPS).uniform_())

    def forward(self, x):
        probs = self.proj(x).view(x.shape[0], GROUPS, ENTRIES).softmax(-1)
        codes = self.codevectors.view(GROUPS, ENTRIES, -1)
        return torch.einsum("bgv,gvd->bgd", probs, codes).flatten(1)


def main():
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = Quantizer()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=DS_CONFIG
    )
    for step in range(1000):
        x = torch.randn(8, DIM, device=engine.device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step % 100 == 0:
            with torch.no_grad():
                cv = engine.module.codevectors.float().view(GROUPS, ENTRIES, -1)  # expect: zero3-partitioned-parameters
                sim = torch.einsum("gvd,gwd->gvw", F.normalize(cv, dim=-1), F.normalize(cv, dim=-1))
            print(step, sim.mean().item())


if __name__ == "__main__":
    main()
