"""T5 v1.1 (base) span-corruption pretraining on pre-tokenized C4.

The corpus is one long uint16 stream of SentencePiece ids (c4_train.bin, c4_valid.bin),
<eos> between documents.

    torchrun --nproc_per_node=8 05_t5_span_corruption.py --data_dir /data/c4_spm32k \
        --output_dir runs/t5-base --resume
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration

PAD, EOS = 0, 1
SENTINEL_START = 32099  # <extra_id_0>, counts down


def random_spans_noise_mask(length, noise_density, mean_span, rng):
    num_noise = int(round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = max(int(round(num_noise / mean_span)), 1)
    num_nonnoise = length - num_noise

    def segment(n_items, n_segs):
        first = np.zeros(n_items - 1, dtype=bool)
        first[rng.choice(n_items - 1, n_segs - 1, replace=False)] = True
        seg_id = np.concatenate([[0], np.cumsum(first)])
        return np.bincount(seg_id, minlength=n_segs)

    noise_lens = segment(num_noise, num_spans)
    nonnoise_lens = segment(num_nonnoise, num_spans)
    interleaved = np.stack([nonnoise_lens, noise_lens], axis=1).reshape(-1)
    starts = np.cumsum(interleaved)[:-1]
    span_start = np.zeros(length, dtype=bool)
    span_start[starts] = True
    span_num = np.cumsum(span_start)
    return span_num % 2 == 1


def to_sentinel_ids(tokens, mask):
    out, prev, sentinel = [], False, SENTINEL_START
    for t, m in zip(tokens, mask):
        if m and not prev:
            out.append(sentinel)
            sentinel -= 1
        elif not m:
            out.append(int(t))
        prev = m
    out.append(EOS)
    return out


class SpanCorruptionDataset(Dataset):
    def __init__(self, path, raw_len=568, enc_len=512, dec_len=114, seed=0):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.raw_len, self.enc_len, self.dec_len = raw_len, enc_len, dec_len
        self.n = len(self.data) // raw_len
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(self.seed * 1_000_003 + i)
        toks = self.data[i * self.raw_len:(i + 1) * self.raw_len]
        mask = random_spans_noise_mask(self.raw_len, 0.15, 3.0, rng)
        enc = to_sentinel_ids(toks, mask)[: self.enc_len]
        dec = to_sentinel_ids(toks, ~mask)[: self.dec_len]
        enc += [PAD] * (self.enc_len - len(enc))
        labels = dec + [-100] * (self.dec_len - len(dec))
        return torch.tensor(enc), torch.tensor(labels)


def inverse_sqrt(step, warmup):
    return 1.0 / math.sqrt(max(step, warmup)) * math.sqrt(warmup)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_config", default="google/t5-v1_1-base")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--steps", type=int, default=524288)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--ckpt_every", type=int, default=5000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for b, (src, labels) in enumerate(loader):
        if b >= max_batches:
            break
        src, labels = src.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=src, attention_mask=(src != PAD), labels=labels).loss
        ntok = (labels != -100).sum()
        tot += torch.stack([loss.double() * ntok, ntok.double()])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    config = T5Config.from_pretrained(args.model_config)
    config.dropout_rate = 0.0
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: inverse_sqrt(s + 1, args.warmup) * min(1.0, (s + 1) / args.warmup))

    train_ds = SpanCorruptionDataset(os.path.join(args.data_dir, "c4_train.bin"))
    valid_ds = SpanCorruptionDataset(os.path.join(args.data_dir, "c4_valid.bin"), seed=1)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=args.batch_size, sampler=valid_sampler,
                              num_workers=2, pin_memory=True)

    step, epoch, skip_batches = 0, 0, 0
    ckpt_path = os.path.join(args.output_dir, "latest.pt")
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, skip_batches = state["step"], state["epoch"], state["batch_in_epoch"]
        if is_main:
            print(f"resumed from step {step} (epoch {epoch}, batch {skip_batches})")
        del state

    model = DDP(model, device_ids=[local_rank])
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)

    model.train()
    t0 = time.time()
    done = False
    while not done:
        train_sampler.set_epoch(epoch)
        for i, (src, labels) in enumerate(train_loader):
            if i < skip_batches:
                continue
            src = src.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=src, attention_mask=(src != PAD), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0 and is_main:
                dt = time.time() - t0
                t0 = time.time()
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{100 * args.batch_size * world / dt:.1f} ex/s")
            if step % args.eval_every == 0:
                vl = evaluate(model, valid_loader, device)
                if is_main:
                    print(f"step {step} valid loss {vl:.4f} ppl {math.exp(vl):.2f}")
            if step % args.ckpt_every == 0:
                if is_main:
                    tmp = ckpt_path + ".tmp"
                    torch.save({"model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(),
                                "step": step, "epoch": epoch, "batch_in_epoch": i + 1}, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
            if step >= args.steps:
                done = True
                break
        skip_batches = 0
        epoch += 1

    if is_main:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
