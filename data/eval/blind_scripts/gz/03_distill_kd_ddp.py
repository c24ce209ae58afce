"""Logit distillation of Qwen2.5-7B-Instruct into Qwen2.5-0.5B with DDP.

The teacher is frozen and replicated on every GPU (bf16, no wrapper); only the
student is trained. Loss = alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE.

    torchrun --nproc_per_node=8 03_distill_kd_ddp.py --data data/sft_mix.jsonl
"""
import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="Qwen/Qwen2.5-7B-Instruct")
    ap.add_argument("--student", default="Qwen/Qwen2.5-0.5B")
    ap.add_argument("--data", default="data/sft_mix.jsonl")
    ap.add_argument("--out", default="runs/kd-qwen-0.5b")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--base_lr", type=float, default=1e-4, help="lr for a global batch of 256 sequences")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.03)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--eval_frac", type=float, default=0.01)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--wandb_project", default="llm-compression")
    return ap.parse_args()


class JsonlSFT(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = self.tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                              tokenize=False, add_generation_prompt=True)
        p_ids = self.tok(prompt, add_special_tokens=False).input_ids
        a_ids = self.tok(r["response"] + self.tok.eos_token, add_special_tokens=False).input_ids
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    n = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = x
        labels[i, : len(y)] = y
        mask[i, : len(x)] = 1
    return ids, mask, labels


def kd_loss(s_logits, t_logits, labels, T, alpha):
    vocab = s_logits.size(-1)
    t_logits = t_logits[..., :vocab]  # teacher has a few padded rows in its lm_head
    s = s_logits[:, :-1].float()
    t = t_logits[:, :-1].float()
    y = labels[:, 1:]
    keep = y != -100
    ce = F.cross_entropy(s[keep], y[keep])
    kl = F.kl_div(F.log_softmax(s[keep] / T, -1), F.log_softmax(t[keep] / T, -1),
                  log_target=True, reduction="batchmean") * T * T
    return alpha * kl + (1 - alpha) * ce, ce.detach(), kl.detach()


@torch.no_grad()
def evaluate(student, teacher, loader, device, args):
    student.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = student(input_ids=ids, attention_mask=mask).logits
            t = teacher(input_ids=ids, attention_mask=mask).logits
        _, ce, kl = kd_loss(s, t, labels, args.temperature, args.alpha)
        sums += torch.stack([ce.double() * ids.size(0), kl.double() * ids.size(0),
                             torch.tensor(ids.size(0), device=device, dtype=torch.float64)])
    dist.all_reduce(sums)
    student.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.student)
    full = JsonlSFT(args.data, tok, args.max_len)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(full), generator=g).tolist()
    n_eval = max(1, int(len(full) * args.eval_frac))
    train_ds, eval_ds = Subset(full, perm[n_eval:]), Subset(full, perm[:n_eval])
    # eval shard without padding so that no sequence is counted twice
    eval_shard = Subset(eval_ds, list(range(rank, len(eval_ds), world)))

    coll = lambda b: collate(b, tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_shard, batch_size=args.micro_bs, collate_fn=coll, num_workers=2)

    # load each rank's teacher replica straight onto its own GPU
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.bfloat16,
                                                   device_map={"": local_rank})
    teacher.eval().requires_grad_(False)
    student = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32).to(device)
    model = DDP(student, device_ids=[local_rank], output_device=local_rank)

    global_bs = args.micro_bs * args.accum * world
    lr = args.base_lr * global_bs / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    steps_per_epoch = len(train_dl) // args.accum
    total = steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    start_epoch, step = 0, 0
    if args.resume:
        ck = torch.load(os.path.join(args.resume, "state.pt"), map_location="cpu")
        model.module.load_state_dict(ck["student"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config={**vars(args), "global_bs": global_bs, "lr": lr})

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (ids, mask, labels) in enumerate(train_dl):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            last_micro = (it + 1) % args.accum == 0
            sync_ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with sync_ctx:
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    t_logits = teacher(input_ids=ids, attention_mask=mask).logits
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s_logits = model(input_ids=ids, attention_mask=mask).logits
                loss, ce, kl = kd_loss(s_logits, t_logits, labels, args.temperature, args.alpha)
                (loss / args.accum).backward()
            if not last_micro:
                continue
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                stats = torch.stack([loss.detach(), ce, kl]).float()
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": stats[0].item(), "train/ce": stats[1].item(),
                               "train/kl": stats[2].item(), "grad_norm": gn.item(),
                               "lr": sched.get_last_lr()[0], "sec_per_step": (time.time() - t0) / 20}, step=step)
                t0 = time.time()
            if step >= steps_per_epoch * (epoch + 1):
                break

        ev_ce, ev_kl = evaluate(model.module, teacher, eval_dl, device, args)
        if rank == 0:
            print(f"epoch {epoch} eval ce {ev_ce:.4f} ppl {math.exp(ev_ce):.2f} kl {ev_kl:.4f}", flush=True)
            wandb.log({"eval/ce": ev_ce, "eval/kl": ev_kl, "eval/ppl": math.exp(ev_ce)}, step=step)
            ckdir = os.path.join(args.out, f"epoch{epoch}")
            model.module.save_pretrained(ckdir, safe_serialization=True)
            tok.save_pretrained(ckdir)
            torch.save({"student": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(ckdir, "state.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
