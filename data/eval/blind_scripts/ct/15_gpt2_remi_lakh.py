"""GPT-2 on multi-track REMI+ (miditok, programs in one stream) from LMD-matched.
At the end the best checkpoint is evaluated on the test split and used for a batch of demo generations.

torchrun --nproc_per_node=8 15_gpt2_remi_lakh.py --data data/lmd_matched_remi --out runs/gpt2_lmd
"""
import argparse
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import REMI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="dir with {train,valid,test}.jsonl (one tokenised piece per line)")
    p.add_argument("--out", default="runs/gpt2_lmd")
    p.add_argument("--n_ctx", type=int, default=1024)
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--n_layer", type=int, default=12)
    p.add_argument("--per_gpu_batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--n_demo", type=int, default=8)
    return p.parse_args()


def read_split(path):
    with open(path) as f:
        return [np.asarray(json.loads(line)["ids"], dtype=np.int32) for line in f]


class Windows(Dataset):
    def __init__(self, pieces, n_ctx, pad, lo=None, hi=None, max_shift=0):
        self.pieces, self.n_ctx, self.pad = pieces, n_ctx, pad
        self.lo, self.hi, self.max_shift = lo, hi, max_shift
        self.index = [(i, s) for i, p in enumerate(pieces) for s in range(0, max(1, len(p) - n_ctx // 2), n_ctx)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        w = self.pieces[i][s:s + self.n_ctx].astype(np.int64)
        if self.max_shift:
            m = (w >= self.lo) & (w <= self.hi)       # melodic Pitch_* only; drums use PitchDrum_*
            if m.any():
                d = random.randint(-self.max_shift, self.max_shift)
                if w[m].min() + d >= self.lo and w[m].max() + d <= self.hi:
                    w[m] += d
        x = np.full(self.n_ctx, self.pad, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


def lm_stats(logits, ids, pad, is_pitch):
    logits, y = logits[:, :-1].float(), ids[:, 1:]
    valid = y != pad
    nll = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=pad, reduction="sum")
    pm = valid & is_pitch[y]
    return torch.stack([nll, valid.sum().float(), ((logits.argmax(-1) == y) & pm).sum().float(), pm.sum().float()])


@torch.no_grad()
def evaluate(net, loader, device, pad, is_pitch, reduce=True):
    net.eval()
    tot = torch.zeros(4, device=device)
    for ids in loader:
        ids = ids.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(input_ids=ids, attention_mask=(ids != pad).long()).logits
        tot += lm_stats(logits, ids, pad, is_pitch)
    if reduce:
        dist.all_reduce(tot)
    net.train()
    return math.exp(tot[0] / tot[1]), (tot[2] / tot[3]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    tok = REMI(params=Path(args.data) / "tokenizer.json")
    pad = tok["PAD_None"]
    pitch_ids = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    is_pitch = torch.zeros(len(tok), dtype=torch.bool, device=device)
    is_pitch[pitch_ids] = True

    train_ds = Windows(read_split(Path(args.data) / "train.jsonl"), args.n_ctx, pad, pitch_ids[0], pitch_ids[-1], 6)
    val_ds = Windows(read_split(Path(args.data) / "valid.jsonl"), args.n_ctx, pad)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.per_gpu_batch, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.per_gpu_batch, num_workers=2)

    config = GPT2Config(vocab_size=len(tok), n_positions=args.n_ctx, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=args.n_embd // 64, bos_token_id=tok["BOS_None"], eos_token_id=tok["EOS_None"],
                        pad_token_id=pad)
    model = DDP(GPT2LMHeadModel(config).to(device), device_ids=[local_rank])
    lr = args.lr * world * args.per_gpu_batch / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, args.warmup_steps, args.epochs * len(train_dl))

    out = Path(args.out)
    writer = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(out / "tb")

    best, step = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids in train_dl:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=(ids != pad).long(),
                             labels=ids.masked_fill(ids == pad, -100)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        ppl, pacc = evaluate(model.module, val_dl, device, pad, is_pitch)
        if rank == 0:
            writer.add_scalar("valid/ppl", ppl, epoch)
            writer.add_scalar("valid/pitch_acc", pacc, epoch)
            print(f"epoch {epoch}: valid ppl {ppl:.3f} pitch acc {pacc:.4f}", flush=True)
            torch.save(model.state_dict(), out / f"epoch{epoch:02d}.pt")
            if ppl < best:
                best = ppl
                torch.save(model.state_dict(), out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()

    if rank == 0:
        writer.close()
        # final test-set numbers and demo generations from the best epoch (single process from here on)
        final = GPT2LMHeadModel(config)
        final.load_state_dict(torch.load(out / "best.pt", map_location="cpu"))
        final.to(device).eval()
        test_ds = Windows(read_split(Path(args.data) / "test.jsonl"), args.n_ctx, pad)
        test_ppl, test_pacc = evaluate(final, DataLoader(test_ds, 16, num_workers=4), device, pad, is_pitch,
                                       reduce=False)
        with open(out / "test_metrics.json", "w") as f:
            json.dump({"test_ppl": test_ppl, "test_pitch_acc": test_pacc, "best_valid_ppl": best}, f, indent=2)
        start = torch.full((args.n_demo, 1), tok["BOS_None"], device=device)
        gens = final.generate(start, do_sample=True, max_new_tokens=args.n_ctx - 1, top_k=50, pad_token_id=pad)
        for k, g in enumerate(gens):
            tok.decode(g[g != pad].tolist()).dump_midi(out / f"demo_{k}.mid")

if __name__ == "__main__":
    main()
