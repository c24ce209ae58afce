"""DeepSpeed ZeRO-3 weights saved the ways DeepSpeed documents (no finding expected).

save_16bit_model on every rank, save_checkpoint on every rank, a
state_dict read inside GatheredParameters, and save_pretrained handed the
16-bit state_dict the engine gathered on every rank; a weight sync that gathers one
parameter at a time on every rank, and a loop that only sets flags.
"""

import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}


def push_to_server(name, tensor):
    print(name, tuple(tensor.shape))


def main():
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=DS_CONFIG
    )
    for _ in range(100):
        loss = engine(torch.randn(8, 64, device=engine.device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if dist.get_rank() == 0:
                    push_to_server(name, param.data)
    for param in engine.module.parameters():
        param.requires_grad_(False)
    engine.save_16bit_model("export", "model.bin")
    engine.save_checkpoint("checkpoints")
    full = engine._zero3_consolidated_16bit_state_dict()  # every rank takes part
    if dist.get_rank() == 0:
        engine.module.save_pretrained("export", state_dict=full)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            torch.save(engine.module.state_dict(), "gathered.bin")


if __name__ == "__main__":
    main()
