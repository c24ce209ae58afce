"""Pop piano (POP909) REMI language model with DeepSpeed ZeRO-2.

    deepspeed --num_gpus 4 09_pop909_deepspeed_zero2.py --pop909 /data/POP909 --out runs/pop909_remi

Resume is automatic: the latest DeepSpeed checkpoint in --out is loaded if present.
"""
import argparse
import math
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pop909", required=True)
    p.add_argument("--out", default="runs/pop909_remi")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--n_samples", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args()


class SongChunks(Dataset):
    """Fixed-length windows over the token stream of each song (hop = ctx // 2)."""

    def __init__(self, songs, ctx, pad_id):
        self.items = []
        for ids in songs:
            for s in range(0, max(1, len(ids) - ctx // 4), ctx // 2):
                self.items.append(ids[s:s + ctx + 1])
        self.ctx, self.pad_id = ctx, pad_id

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids = self.items[i]
        x = torch.full((self.ctx + 1,), self.pad_id, dtype=torch.long)
        x[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        return x


def tokenize_pop909(root, tokenizer):
    """POP909 song folders are 001..909; every 10th song is held out for validation."""
    train, val = [], []
    for song_dir in sorted(Path(root).glob("[0-9][0-9][0-9]")):
        midi = song_dir / f"{song_dir.name}.mid"
        ids = tokenizer.encode(midi).ids
        (val if int(song_dir.name) % 10 == 0 else train).append(ids)
    return train, val


def step_loss(model, batch, pad_id):
    x, y = batch[:, :-1], batch[:, 1:].clone()
    y[y == pad_id] = -100
    logits = model(input_ids=x, attention_mask=(x != pad_id).long()).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"), \
        (y != -100).sum()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = REMI(TokenizerConfig(num_velocities=32, use_chords=True, use_tempos=True,
                                     use_programs=True, one_token_stream_for_programs=True,
                                     special_tokens=["PAD", "BOS", "EOS"]))
    pad_id = tokenizer.pad_token_id
    # 909 songs: tokenizing in memory on every rank takes ~20 s, nothing is written to disk
    train_songs, val_songs = tokenize_pop909(args.pop909, tokenizer)
    train_ds = SongChunks(train_songs, args.ctx, pad_id)
    val_ds = SongChunks(val_songs, args.ctx, pad_id)

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=909)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.micro_bs)

    total_updates = args.epochs * (len(train_dl) // args.grad_accum)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup, "total_num_steps": total_updates}},
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.ctx, n_embd=512, n_layer=8, n_head=8,
                        bos_token_id=tokenizer["BOS_None"], eos_token_id=tokenizer["EOS_None"],
                        pad_token_id=pad_id)
    model = GPT2LMHeadModel(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_epoch = 0
    load_path, client_state = engine.load_checkpoint(args.out)
    if load_path is not None:
        start_epoch = client_state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {load_path} at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in train_dl:
            batch = batch.to(device, non_blocking=True)
            s, n = step_loss(engine, batch, pad_id)
            loss = s / n.clamp(min=1)
            engine.backward(loss)
            engine.step()

        # validation: each rank scores its strided shard, sums are reduced
        engine.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in val_dl:
                s, n = step_loss(engine.module, batch.to(device), pad_id)
                tot[0] += s
                tot[1] += n
        dist.all_reduce(tot)
        val_nll = (tot[0] / tot[1]).item()

        if rank == 0:
            print(f"epoch {epoch} val nll {val_nll:.4f} ppl {math.exp(val_nll):.2f} "
                  f"lr {engine.get_lr()[0]:.2e}", flush=True)
            # ZeRO-2 keeps a full copy of the weights on every rank, so sampling on rank 0 is local
            prompt = torch.tensor([[tokenizer["BOS_None"]]] * args.n_samples, device=device)
            with torch.no_grad():
                gen = engine.module.generate(prompt, do_sample=True, top_p=0.95, temperature=1.0,
                                             max_new_tokens=args.ctx - 1, pad_token_id=pad_id)
            sample_dir = Path(args.out) / "samples" / f"epoch{epoch:03d}"
            sample_dir.mkdir(parents=True, exist_ok=True)
            for i, ids in enumerate(gen.tolist()):
                tokenizer.decode([ids]).dump_midi(sample_dir / f"{i}.mid")

        # every rank writes its own ZeRO shard; DeepSpeed handles the file layout
        engine.save_checkpoint(args.out, tag=f"epoch{epoch:03d}", client_state={"epoch": epoch})
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
