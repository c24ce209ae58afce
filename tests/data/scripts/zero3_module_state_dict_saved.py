"""DeepSpeed ZeRO-3: rank 0 saves engine.module.state_dict(), whose parameters
are torch.Size([0]) placeholders outside the engine's own gathers, and exports
a Hugging Face model with save_pretrained, which reads the same state_dict; and
a weight sync to a generation server that sends each parameter's placeholder."""

import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}


def push_to_server(name, tensor):
    print(name, tuple(tensor.shape))


def sync_weights(engine):
    for name, param in engine.module.named_parameters():  # expect: zero3-partitioned-parameters
        push_to_server(name, param.data)


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
        if dist.get_rank() == 0:
            sync_weights(engine)
    if dist.get_rank() == 0:
        torch.save(engine.module.state_dict(), "model.bin")  # expect: zero3-partitioned-parameters
        engine.module.save_pretrained("export")  # expect: zero3-partitioned-parameters


if __name__ == "__main__":
    main()
