"""Pairwise reward model (sequence classifier with one logit) on a mix of preference sets.

Writes per-pair eval margins to <out>/eval_margins_stepN.jsonl so we can look at
calibration against annotator agreement afterwards.

    torchrun --nproc_per_node=8 02_rm_seqcls_ddp.py --base Qwen/Qwen2.5-1.5B-Instruct \
        --train data/rm_mix_train.jsonl --test data/rm_mix_test.jsonl --out runs/rm-qwen1.5b
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class PrefData(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(x) for x in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def _ids(self, prompt, answer):
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        ids = self.tok.apply_chat_template(msgs, tokenize=True)
        return ids[-self.max_len:]  # keep the end: the answer is what is being scored

    def __getitem__(self, i):
        r = self.rows[i]
        return i, self._ids(r["prompt"], r["chosen"]), self._ids(r["prompt"], r["rejected"])


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        idx = torch.tensor([b[0] for b in batch])
        seqs = [b[1] for b in batch] + [b[2] for b in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for k, s in enumerate(seqs):
            ids[k, : len(s)] = torch.tensor(s)
            att[k, : len(s)] = 1
        return idx, ids, att


def forward_rewards(model, ids, att):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=ids, attention_mask=att).logits.squeeze(-1).float()


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    local = []
    for idx, ids, att in loader:
        r = forward_rewards(model, ids.to(device), att.to(device))
        n = idx.numel()
        margins = (r[:n] - r[n:]).cpu().tolist()
        local.extend(zip(idx.tolist(), margins))
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    # DistributedSampler pads the last round with repeats; keep one margin per pair
    merged = {}
    for part in gathered:
        for i, m in part:
            merged[i] = m
    acc = sum(m > 0 for m in merged.values()) / len(merged)
    mean_margin = sum(merged.values()) / len(merged)
    return acc, mean_margin, merged


def main():
    args = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # different dropout masks per rank; parameters are broadcast from rank 0 when DDP is built
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    train_ds = PrefData(args.train, tok, args.max_len)
    test_ds = PrefData(args.test, tok, args.max_len)
    collate = Collator(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=args.bs * 2, sampler=test_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    n_updates = (len(train_dl) // args.accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, n_updates)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    upd, t0 = 0, time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for it, (_, ids, att) in enumerate(train_dl):
            if it >= (len(train_dl) // args.accum) * args.accum:
                break
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            boundary = (it + 1) % args.accum == 0
            if not boundary:
                with ddp.no_sync():
                    r = forward_rewards(ddp, ids, att)
                    n = r.numel() // 2
                    loss = -F.logsigmoid(r[:n] - r[n:]).mean()
                    (loss / args.accum).backward()
                continue
            r = forward_rewards(ddp, ids, att)
            n = r.numel() // 2
            loss = -F.logsigmoid(r[:n] - r[n:]).mean()
            (loss / args.accum).backward()
            gn = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1

            if upd % 10 == 0:
                s = torch.stack([loss.detach(), (r[:n] > r[n:]).float().mean().detach(), r.detach().mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", s[0].item(), upd)
                    writer.add_scalar("train/acc", s[1].item(), upd)
                    writer.add_scalar("train/mean_reward", s[2].item(), upd)
                    writer.add_scalar("train/grad_norm", gn.item(), upd)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], upd)

            if upd % args.eval_every == 0:
                acc, mm, merged = evaluate(ddp, test_dl, device, world)
                if rank == 0:
                    writer.add_scalar("eval/acc", acc, upd)
                    writer.add_scalar("eval/margin", mm, upd)
                    with open(os.path.join(args.out, f"eval_margins_step{upd}.jsonl"), "w") as f:
                        for i in sorted(merged):
                            f.write(json.dumps({"idx": i, "margin": merged[i]}) + "\n")
                    print(f"upd {upd} eval acc {acc:.4f} margin {mm:.3f} ({time.time() - t0:.0f}s)", flush=True)

    acc, mm, _ = evaluate(ddp, test_dl, device, world)
    if rank == 0:
        print(f"final eval acc {acc:.4f} margin {mm:.3f}")
        ddp.module.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
