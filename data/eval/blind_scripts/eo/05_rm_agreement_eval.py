#!/usr/bin/env python
# Reward model training with an agreement-stratified eval.
#
# Each eval pair carries the fraction of annotators who agreed with the majority label.
# Besides plain accuracy we report accuracy and ROC-AUC on the high-agreement subset,
# which is a much cleaner signal than the full noisy test set.
#
#   torchrun --nproc_per_node=8 05_rm_agreement_eval.py --base ckpts/mistral-nemo-minitron-4b-sft \
#       --train data/rm_train.jsonl --eval data/rm_eval_with_agreement.jsonl --out runs/rm-4b
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--min_agreement", type=float, default=0.8)
    return p.parse_args()


class RMPairs(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def _encode(self, prompt, answer):
        ids = self.tok.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], tokenize=True)
        return ids[-self.max_len:]

    def __getitem__(self, i):
        r = self.rows[i]
        return (self._encode(r["prompt"], r["chosen"]), self._encode(r["prompt"], r["rejected"]),
                float(r.get("agreement", 1.0)))


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [b[0] for b in batch] + [b[1] for b in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        agreement = torch.tensor([b[2] for b in batch], dtype=torch.float32)
        return ids, att, agreement


def score(model, ids, att):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()


@torch.no_grad()
def evaluate(model, loader, device, world, min_agreement):
    model.eval()
    all_margins, hi_margins = [], []
    for ids, att, agreement in loader:
        r = score(model, ids.to(device), att.to(device))
        n = r.numel() // 2
        margin = r[:n] - r[n:]
        all_margins.append(margin)
        hi_margins.append(margin[agreement.to(device) >= min_agreement])
    all_margins = torch.cat(all_margins)
    hi_margins = torch.cat(hi_margins)

    stats = torch.stack([(all_margins > 0).float().sum(), all_margins.new_tensor(all_margins.numel())])
    dist.all_reduce(stats)

    gathered = [torch.zeros_like(hi_margins) for _ in range(world)]
    dist.all_gather(gathered, hi_margins)
    hi = torch.cat(gathered).cpu().numpy()
    model.train()

    out = {"acc": (stats[0] / stats[1]).item(), "n_hi": int(hi.size)}
    if hi.size > 0:
        out["acc_hi"] = float((hi > 0).mean())
        # AUC of "chosen beats rejected" vs the sign-flipped pair
        y = np.concatenate([np.ones_like(hi), np.zeros_like(hi)])
        s = np.concatenate([hi, -hi])
        out["auc_hi"] = float(roc_auc_score(y, s))
    return out


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    train_ds = RMPairs(args.train, tok, args.max_len)
    eval_ds = RMPairs(args.eval, tok, args.max_len)
    collate = Collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.bs * 2, sampler=eval_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        metrics_f = open(os.path.join(args.out, "eval.jsonl"), "a")

    step, t0, best_auc = 0, time.time(), 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for ids, att, _ in train_dl:
            r = score(model, ids.to(device, non_blocking=True), att.to(device, non_blocking=True))
            n = r.numel() // 2
            loss = -F.logsigmoid(r[:n] - r[n:]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                m = torch.stack([loss.detach(), (r[:n] > r[n:]).float().mean().detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {m[0]:.4f} acc {m[1]:.3f} ({time.time() - t0:.0f}s)", flush=True)

            if step % args.eval_every == 0 or step == total:
                res = evaluate(model, eval_dl, device, world, args.min_agreement)
                if rank == 0:
                    res["step"] = step
                    print("eval", json.dumps(res), flush=True)
                    metrics_f.write(json.dumps(res) + "\n")
                    metrics_f.flush()
                    if res.get("auc_hi", 0.0) > best_auc:
                        best_auc = res["auc_hi"]
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        metrics_f.close()
        model.module.save_pretrained(os.path.join(args.out, "last"))
        tok.save_pretrained(os.path.join(args.out, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
