"""Continue MLM pretraining of ESM-2 650M on MGnify metagenomic proteins.

Runs on the 8-GPU nodes in 4 h slurm slots, so it checkpoints often and
resumes from the newest checkpoint in --out-dir automatically.

    torchrun --nproc_per_node=8 07_esm2_resume.py --train mgnify_train.txt --valid mgnify_valid.txt
"""
import argparse
import glob
import math
import os
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, EsmForMaskedLM,
                          get_cosine_schedule_with_warmup)


class LineSeqs(Dataset):
    """One amino-acid sequence per line."""

    def __init__(self, path, max_len):
        with open(path) as fh:
            self.seqs = [l.strip()[:max_len] for l in fh if l.strip()]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]


class TokenizeAndMask:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len
        self.mlm = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)

    def __call__(self, seqs):
        enc = self.tok(seqs, padding=True, truncation=True, max_length=self.max_len + 2,
                       return_special_tokens_mask=True)
        features = [{k: enc[k][i] for k in enc} for i in range(len(seqs))]
        return self.mlm(features)


def latest_checkpoint(out_dir):
    paths = glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
    if not paths:
        return None
    return max(paths, key=lambda p: int(re.search(r"ckpt_(\d+)\.pt", p).group(1)))


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum()
        s[0] += out.loss.double() * n
        s[1] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--init", default="facebook/esm2_t33_650M_UR50D")
    ap.add_argument("--out-dir", default="/projects/esm2_mgnify/ckpt")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.init)
    model = EsmForMaskedLM.from_pretrained(args.init)
    model.esm.contact_head.requires_grad_(False)    # not part of the MLM objective
    model = DDP(model.to(device), device_ids=[local_rank])

    train_ds = LineSeqs(args.train, args.max_len)
    valid_ds = LineSeqs(args.valid, args.max_len)
    collate = TokenizeAndMask(tokenizer, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=32,
                              collate_fn=collate, num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.epochs * steps_per_epoch)

    step, start_epoch, skip = 0, 0, 0
    resume = latest_checkpoint(args.out_dir)
    if resume is not None:
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
        start_epoch, skip = divmod(step, steps_per_epoch)
        del ckpt
        if rank == 0:
            print(f"resumed from {resume} at step {step}", flush=True)
    elif rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    model.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            if epoch == start_epoch and i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0 and rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {100 / (time.time() - t0):.2f} it/s", flush=True)
                t0 = time.time()

            if step % args.save_every == 0:
                if rank == 0:
                    path = os.path.join(args.out_dir, f"ckpt_{step}.pt")
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "step": step}, path + ".tmp")
                    os.replace(path + ".tmp", path)
                    for old in sorted(glob.glob(os.path.join(args.out_dir, "ckpt_*.pt")),
                                      key=os.path.getmtime)[:-args.keep]:
                        os.remove(old)
                dist.barrier()

        vloss = validate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid loss {vloss:.4f} ppl {math.exp(vloss):.3f}", flush=True)

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.out_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
