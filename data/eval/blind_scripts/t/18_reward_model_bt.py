"""
Bradley-Terry reward model for the PPO / GRPO pipelines: a causal LM with a
scalar head, trained on Skywork preference pairs with DDP. The checkpoint
with the best held-out pairwise accuracy is kept as `best/`.

    torchrun --standalone --nproc_per_node=8 18_reward_model_bt.py \
        --base Qwen/Qwen2.5-1.5B-Instruct --out ckpt/rm_q15 --epochs 1
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="Qwen/Qwen2.5-1.5B-Instruct")
    ap.add_argument("--dataset", default="Skywork/Skywork-Reward-Preference-80K-v0.2")
    ap.add_argument("--out", default="ckpt/rm")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--center_coef", type=float, default=0.01, help="pull mean reward towards 0")
    return ap.parse_args()


class Collator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, rows):
        texts = [self.tok.apply_chat_template(r["chosen"], tokenize=False) for r in rows] + \
                [self.tok.apply_chat_template(r["rejected"], tokenize=False) for r in rows]
        enc = self.tok(texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt",
                       add_special_tokens=False)
        return enc.input_ids, enc.attention_mask


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, torch_dtype=torch.bfloat16)
    model.config.pad_token_id = tok.pad_token_id
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    data = load_dataset(args.dataset, split="train").train_test_split(test_size=2000, seed=0)
    coll = Collator(tok, args.max_len)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True)
    val_sampler = DistributedSampler(data["test"], shuffle=False)
    val_dl = DataLoader(data["test"], batch_size=args.batch_size, sampler=val_sampler, collate_fn=coll)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.03 * total), total)

    def score(ids, attn):
        return model(input_ids=ids, attention_mask=attn).logits.squeeze(-1).float()

    @torch.no_grad()
    def evaluate():
        model.eval()
        correct, seen, margin = 0, 0, 0.0
        for ids, attn in val_dl:
            r = score(ids.to(device), attn.to(device))
            n = r.shape[0] // 2
            correct += (r[:n] > r[n:]).sum().item()
            margin += (r[:n] - r[n:]).sum().item()
            seen += n
        model.train()
        return correct / max(seen, 1), margin / max(seen, 1)

    best_acc, step = -1.0, 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for ids, attn in train_dl:
            ids, attn = ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
            r = score(ids, attn)
            n = r.shape[0] // 2
            loss = -F.logsigmoid(r[:n] - r[n:]).mean() + args.center_coef * r.pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 20 == 0:
                stats = torch.stack([loss.detach(), (r[:n] > r[n:]).float().mean().detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {stats[0]:.4f} acc {stats[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                    t0 = time.time()

            if step % args.eval_every == 0 or step == total:
                acc, margin = evaluate()
                if rank == 0:
                    print(f"[eval] step {step} pair_acc {acc:.4f} margin {margin:.3f}", flush=True)
                    if acc > best_acc:
                        best_acc = acc
                        out = os.path.join(args.out, "best")
                        model.module.save_pretrained(out, safe_serialization=True)
                        tok.save_pretrained(out)
                        with open(os.path.join(out, "eval.json"), "w") as f:
                            json.dump({"step": step, "pair_acc": acc, "margin": margin}, f)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "last"))
        print(f"best held-out pair accuracy {best_acc:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
