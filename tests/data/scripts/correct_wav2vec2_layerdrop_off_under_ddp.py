"""The same small wav2vec2 CTC model, fixed the way such code is under a strict
DDP: LayerDrop off by default (no finding expected).

Runs under torchrun: every parameter gets a gradient in each backward.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layerdrop", type=float, default=0.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(
        Wav2Vec2Config(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=(16, 16),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            vocab_size=8,
            mask_time_prob=0.0,
            layerdrop=args.layerdrop,
        )
    )
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(12):
        audio = torch.randn(2, 800)
        labels = torch.randint(1, 8, (2, 4))
        loss = model(audio, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    # both ranks done before either tears down gloo: a rank that destroyed its group
    # while the other still shut its own down left that one waiting (seen under load)
    dist.barrier()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
