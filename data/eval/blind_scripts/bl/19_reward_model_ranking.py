"""
InstructGPT-style reward model: each prompt comes with K responses ranked by
labellers; all C(K, 2) comparisons of one prompt are kept in the same batch.

    torchrun --nproc_per_node=8 19_reward_model_ranking.py \
        --train data/rankings_train.jsonl --eval data/rankings_eval.jsonl --backbone EleutherAI/pythia-1b
"""
import argparse
import itertools
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("rm")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--backbone", default="EleutherAI/pythia-1b")
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--prompts-per-batch", type=int, default=4, help="per GPU; each prompt has K responses")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--warmup", type=float, default=0.05)
    ap.add_argument("--out", default="rm_ranking")
    ap.add_argument("--log-every", type=int, default=25)
    return ap.parse_args()


class RankedResponses(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f if l.strip()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        # responses reordered best -> worst
        ordered = [row["responses"][j] for j in row["ranking"]]
        return row["prompt"], ordered


class Collator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        texts, groups = [], []
        for prompt, responses in batch:
            start = len(texts)
            texts += [prompt + r + self.tok.eos_token for r in responses]
            groups.append((start, len(responses)))
        enc = self.tok(texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], groups


class RewardModel(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(backbone)
        self.head = nn.Linear(self.backbone.config.hidden_size, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (self.backbone.config.hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(1) - 1  # right padding: index of the final real token
        return self.head(h[torch.arange(h.shape[0], device=h.device), last]).squeeze(-1)


def ranking_loss(scores, groups):
    losses, correct, total = [], 0, 0
    for start, k in groups:
        s = scores[start:start + k]
        for i, j in itertools.combinations(range(k), 2):  # i ranked above j
            losses.append(-F.logsigmoid(s[i] - s[j]))
            correct += int((s[i] > s[j]).item())
            total += 1
    return torch.stack(losses).mean(), correct, total


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)  # loss_sum, correct, pairs
    for ids, mask, groups in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = model(ids.to(device), mask.to(device)).float()
        loss, c, n = ranking_loss(scores, groups)
        acc += torch.tensor([loss.item() * n, c, n], dtype=torch.float64, device=device)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2].clamp(min=1)).item(), (acc[1] / acc[2].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.backbone)
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "right"
    collate = Collator(tok, args.max_len)

    train_ds = RankedResponses(args.train)
    train_loader = DataLoader(train_ds, batch_size=args.prompts_per_batch, shuffle=True,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    eval_ds = RankedResponses(args.eval)
    eval_shard = Subset(eval_ds, range(rank, len(eval_ds), world))
    eval_loader = DataLoader(eval_shard, batch_size=args.prompts_per_batch, collate_fn=collate, num_workers=2)

    model = RewardModel(args.backbone).to(device)
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total_steps), total_steps)
    logger.info("train prompts=%d  steps=%d  world=%d", len(train_ds), total_steps, world)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        for ids, mask, groups in train_loader:
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores = model(ids, mask).float()
            loss, c, n = ranking_loss(scores, groups)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % args.log_every == 0:
                t = torch.tensor([loss.item(), c / n], device=device)
                dist.all_reduce(t)
                t /= world
                logger.info("epoch %d step %d/%d loss %.4f pair-acc %.3f lr %.2e",
                            epoch, step, total_steps, t[0].item(), t[1].item(), sched.get_last_lr()[0])

        ev_loss, ev_acc = evaluate(model.module, eval_loader, device)
        logger.info("epoch %d eval loss %.4f pair-acc %.4f", epoch, ev_loss, ev_acc)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, f"rm_epoch{epoch}.pt"))
            if ev_acc > best:
                best = ev_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "rm_best.pt"))
                tok.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
