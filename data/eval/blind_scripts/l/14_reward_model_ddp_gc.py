#!/usr/bin/env python
# Bradley-Terry reward model on chosen/rejected pairs (HelpSteer2-preference style jsonl).
#   torchrun --standalone --nproc_per_node=8 14_reward_model_ddp_gc.py \
#       --base meta-llama/Llama-3.2-3B-Instruct --train data/prefs_train.jsonl --val data/prefs_val.jsonl
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


class PairDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f if l.strip()]
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def _enc(self, prompt, resp):
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": resp}]
        ids = self.tok.apply_chat_template(msgs, tokenize=True)
        return ids[-self.max_len:]

    def __getitem__(self, i):
        r = self.rows[i]
        return self._enc(r["prompt"], r["chosen"]), self._enc(r["prompt"], r["rejected"])


def make_collate(pad_id):
    def collate(batch):
        seqs = [c for c, _ in batch] + [r for _, r in batch]
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        return ids, att
    return collate


def bt_loss(rewards):
    n = rewards.size(0) // 2
    chosen, rejected = rewards[:n], rewards[n:]
    return -F.logsigmoid(chosen - rejected).mean(), (chosen > rejected).float()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for ids, att in loader:
        ids, att = ids.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
        _, hits = bt_loss(r)
        acc[0] += hits.sum()
        acc[1] += hits.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="meta-llama/Llama-3.2-3B-Instruct")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4, help="pairs per GPU")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", default="rm_out")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1,
                                                               torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_ds = PairDataset(args.train, tok, args.max_len)
    val_ds = PairDataset(args.val, tok, args.max_len)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    coll = make_collate(tok.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=va_sampler, collate_fn=coll,
                        num_workers=2, drop_last=True)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.03 * total), total)

    if rank == 0:
        print(f"{len(train_ds)} train pairs, {world} GPUs, {total} steps", flush=True)

    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, att in train_dl:
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                rewards = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
            loss, hits = bt_loss(rewards)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                s = torch.stack([loss.detach(), hits.mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {s[0]:.4f} acc {s[1]:.3f} "
                          f"{(time.time() - t0) / step:.2f}s/it", flush=True)

        val_acc = validate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val pairwise acc {val_acc:.4f}", flush=True)
            d = os.path.join(args.out, f"epoch{epoch}")
            model.module.save_pretrained(d)
            tok.save_pretrained(d)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
