"""Bradley-Terry reward model on UltraFeedback (binarized) pairs.

Usage:
    torchrun --nproc_per_node=4 08_rm_ultrafeedback.py --base meta-llama/Llama-3.2-1B-Instruct --out runs/rm-llama1b
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("rm")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", default="HuggingFaceH4/ultrafeedback_binarized")
    ap.add_argument("--out", default="runs/rm")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--bsz", type=int, default=4, help="pairs per device")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=0.0)
    ap.add_argument("--warmup_ratio", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--center_rewards", type=float, default=0.01, help="coefficient of the mean-zero reward penalty")
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class PairDataset(Dataset):
    def __init__(self, hf_split, tokenizer, max_len):
        self.rows = hf_split
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def _encode(self, messages):
        text = self.tok.apply_chat_template(messages, tokenize=False)
        ids = self.tok(text, add_special_tokens=False, truncation=True, max_length=self.max_len)["input_ids"]
        return ids

    def __getitem__(self, i):
        row = self.rows[i]
        return self._encode(row["chosen"]), self._encode(row["rejected"])


class PairCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, items):
        seqs = [c for c, _ in items] + [r for _, r in items]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for k, s in enumerate(seqs):
            # right padding; the classifier head reads the last non-pad position
            ids[k, : len(s)] = torch.as_tensor(s)
            att[k, : len(s)] = 1
        return ids, att


def pair_loss(rewards, center_coef):
    n = rewards.shape[0] // 2
    chosen, rejected = rewards[:n], rewards[n:]
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_coef > 0:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    return loss, chosen.detach(), rejected.detach()


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    correct, total, margin = 0, 0, 0.0
    for ids, att in loader:
        ids, att = ids.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
        n = r.shape[0] // 2
        correct += (r[:n] > r[n:]).sum().item()
        margin += (r[:n] - r[n:]).sum().item()
        total += n
    model.train()
    return correct / max(total, 1), margin / max(total, 1)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    if rank != 0:
        dist.barrier()  # let rank 0 download / prepare the arrow files first
    ds = load_dataset(args.data)
    if rank == 0:
        dist.barrier()
    train_set = PairDataset(ds["train_prefs"], tok, args.max_len)
    test_set = PairDataset(ds["test_prefs"], tok, args.max_len)

    collator = PairCollator(tok.pad_token_id)
    train_loader = DataLoader(train_set, batch_size=args.bsz, shuffle=True, collate_fn=collator,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.bsz * 2, shuffle=False, collate_fn=collator, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    updates = math.ceil(len(train_loader) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(args.warmup_ratio * updates), updates)
    logger.info("pairs=%d updates=%d world=%d", len(train_set), updates, world)

    update = 0
    best = 0.0
    for epoch in range(args.epochs):
        for it, (ids, att) in enumerate(train_loader):
            ids = ids.to(device, non_blocking=True)
            att = att.to(device, non_blocking=True)
            boundary = (it + 1) % args.accum == 0 or (it + 1) == len(train_loader)
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    rewards = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
                loss, ch, rj = pair_loss(rewards, args.center_rewards)
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        rewards = model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()
                    loss, ch, rj = pair_loss(rewards, args.center_rewards)
                    (loss / args.accum).backward()
                continue

            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            update += 1

            if update % 20 == 0:
                t = torch.stack([loss.detach(), (ch > rj).float().mean()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                logger.info("ep %d upd %d loss %.4f acc %.3f gnorm %.2f lr %.2e",
                            epoch, update, t[0].item(), t[1].item(), gnorm.item(), sched.get_last_lr()[0])

            if update % args.eval_every == 0:
                if rank == 0:
                    acc, margin = run_eval(model.module, test_loader, device)
                    logger.info("eval upd %d acc %.4f margin %.3f", update, acc, margin)
                    if acc > best:
                        best = acc
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        acc, margin = run_eval(model.module, test_loader, device)
        logger.info("final acc %.4f margin %.3f (best %.4f)", acc, margin, best)
        model.module.save_pretrained(os.path.join(args.out, "last"))
        tok.save_pretrained(os.path.join(args.out, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
