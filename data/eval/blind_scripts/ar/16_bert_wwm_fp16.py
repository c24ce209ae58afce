"""
Chinese BERT-base whole-word-masking pretraining (MLM only), fp16 with GradScaler.

Pre-tokenized input: <data>/{train,valid}_ids.npy (int32 [N, 256]) and
<data>/{train,valid}_wordstart.npy (bool [N, 256], True where a token starts a word).

    torchrun --nproc_per_node=4 16_bert_wwm_fp16.py --data /data/zh_wiki_wwm --out runs/bert-zh-wwm
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)
PAD, CLS, SEP, MASK = 0, 101, 102, 103


class WWMDataset(Dataset):
    def __init__(self, data_dir, split, mask_prob=0.15, seed=0):
        self.ids = np.load(os.path.join(data_dir, f"{split}_ids.npy"), mmap_mode="r")
        self.starts = np.load(os.path.join(data_dir, f"{split}_wordstart.npy"), mmap_mode="r")
        self.mask_prob = mask_prob
        self.seed = seed
        self.epoch = 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, self.epoch, i))
        ids = np.array(self.ids[i], dtype=np.int64)
        starts = np.array(self.starts[i], dtype=bool)
        valid = (ids != PAD) & (ids != CLS) & (ids != SEP)
        word_id = np.cumsum(starts) * valid
        n_words = int(word_id.max())
        labels = np.full_like(ids, -100)
        if n_words > 0:
            chosen = rng.random(n_words + 1) < self.mask_prob
            chosen[0] = False
            m = chosen[word_id]
            labels[m] = ids[m]
            r = rng.random(len(ids))
            ids[m & (r < 0.8)] = MASK
            rnd = m & (r >= 0.8) & (r < 0.9)
            ids[rnd] = rng.integers(672, 21128, int(rnd.sum()))
        return {"input_ids": torch.from_numpy(ids),
                "attention_mask": torch.from_numpy(valid | (ids == CLS) | (ids == SEP)).long(),
                "labels": torch.from_numpy(labels)}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup_ratio", type=float, default=0.01)
    p.add_argument("--save_steps", type=int, default=20000)
    p.add_argument("--resume", default=None)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        with torch.cuda.amp.autocast():
            loss = model(**b).loss
        n = (b["labels"] != -100).sum()
        total += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    logging.basicConfig(format=f"[%(asctime)s r{rank}] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    train_ds = WWMDataset(args.data, "train")
    valid_ds = WWMDataset(args.data, "valid", seed=1)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.bs, sampler=DistributedSampler(valid_ds, shuffle=False),
                          num_workers=4)

    config = BertConfig(vocab_size=21128, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512)
    torch.manual_seed(7)
    model = BertForMaskedLM(config)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_dl) * args.epochs // args.accum
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(init_scale=2 ** 14)

    start_epoch, step = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, step = ck["epoch"], ck["step"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("world %d, %d steps, global batch %d", world, total_steps, args.bs * args.accum * world)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_ds.epoch = epoch
        t0, seen = time.time(), 0
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            do_step = (i + 1) % args.accum == 0
            model.require_backward_grad_sync = do_step
            with torch.cuda.amp.autocast():
                loss = model(**batch).loss / args.accum
            scaler.scale(loss).backward()
            seen += batch["input_ids"].size(0)
            if not do_step:
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e scale %.0f %.0f seq/s", epoch, step,
                         loss.item() * args.accum, sched.get_last_lr()[0], scaler.get_scale(),
                         seen * world / (time.time() - t0))
            if step % args.save_steps == 0:
                vl = evaluate(model, valid_dl, device)
                log.info("step %d valid loss %.4f ppl %.2f", step, vl, math.exp(vl))
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                                "epoch": epoch, "step": step}, os.path.join(args.out, f"ckpt-{step}.pt"))
                dist.barrier()
        if rank == 0:
            model.module.save_pretrained(os.path.join(args.out, f"epoch-{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
