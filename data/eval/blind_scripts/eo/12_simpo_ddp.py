"""SimPO: reference-free preference optimisation with length-normalised rewards and a target margin.

    torchrun --nproc_per_node=8 12_simpo_ddp.py --model ckpts/gemma-2-2b-it-sft \
        --train data/on_policy_pairs_train.jsonl --test data/on_policy_pairs_test.jsonl --out runs/simpo-2b
"""
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("simpo")
IGNORE = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beta", type=float, default=10.0)
    ap.add_argument("--gamma_beta_ratio", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=8e-7)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--max_prompt_len", type=int, default=1800)
    ap.add_argument("--eval_every", type=int, default=200)
    return ap.parse_args()


class OnPolicyPairs(Dataset):
    """Rows: {"messages": [...prompt turns...], "chosen": str, "rejected": str}"""

    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                p = tok.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True)
                p = p[-max_prompt_len:]
                c = tok(r["chosen"] + "<end_of_turn>\n", add_special_tokens=False).input_ids
                j = tok(r["rejected"] + "<end_of_turn>\n", add_special_tokens=False).input_ids
                self.rows.append((p, c[: max_len - len(p)], j[: max_len - len(p)]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class PairCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        rows = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(p) + len(x) for p, x in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(rows), T), dtype=torch.long)
        for k, (p, x) in enumerate(rows):
            ids[k, : len(p) + len(x)] = torch.tensor(p + x)
            lab[k, len(p): len(p) + len(x)] = torch.tensor(x)
            att[k, : len(p) + len(x)] = 1
        return ids, att, lab


def avg_logps(model, ids, att, lab):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = tgt != IGNORE
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    avg = (lp * m).sum(-1) / m.sum(-1)
    n = avg.shape[0] // 2
    return avg[:n], avg[n:]


def simpo_loss(c, r, beta, gamma_beta_ratio):
    logits = (c - r) - gamma_beta_ratio
    return -F.logsigmoid(beta * logits).mean(), beta * c.detach(), beta * r.detach()


@torch.no_grad()
def evaluate(model, loader, device, args):
    model.eval()
    agg = torch.zeros(4, device=device)
    for ids, att, lab in loader:
        c, r = avg_logps(model, ids.to(device), att.to(device), lab.to(device))
        loss, rc, rr = simpo_loss(c, r, args.beta, args.gamma_beta_ratio)
        ok = torch.isfinite(rc) & torch.isfinite(rr)
        agg += torch.stack([torch.nan_to_num(loss) * ok.sum(), (rc > rr)[ok].float().sum(),
                            (rc - rr)[ok].sum(), ok.sum().float()])
    dist.all_reduce(agg)
    model.train()
    n = agg[3].clamp(min=1)
    return {"loss": (agg[0] / n).item(), "acc": (agg[1] / n).item(), "margin": (agg[2] / n).item()}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [r{rank}] %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    train = OnPolicyPairs(args.train, tok, args.max_len, args.max_prompt_len)
    test = OnPolicyPairs(args.test, tok, args.max_len, args.max_prompt_len)
    collate = PairCollate(tok.pad_token_id)
    train_sampler = DistributedSampler(train, shuffle=True, seed=42, drop_last=True)
    test_sampler = DistributedSampler(test, shuffle=False, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=train_sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True)
    test_dl = DataLoader(test, batch_size=args.bs, sampler=test_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(args.warmup_ratio * total), total)
    logger.info("train %d pairs, test %d pairs, %d steps on %d GPUs", len(train), len(test), total, world)

    step, t0 = 0, time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for ids, att, lab in train_dl:
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            c, r = avg_logps(model, ids, att, lab)
            loss, rc, rr = simpo_loss(c, r, args.beta, args.gamma_beta_ratio)
            if not torch.isfinite(loss):
                # rare fp blow-ups on very long pairs; drop the batch
                logger.warning("non-finite loss at step %d, skipping batch", step)
                opt.zero_grad(set_to_none=True)
                continue
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                m = torch.stack([loss.detach(), (rc > rr).float().mean(), (rc - rr).mean(), c.detach().mean()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                logger.info("step %d loss %.4f acc %.3f margin %.3f avg_logp_chosen %.3f lr %.2e %.0fs",
                            step, *m.tolist(), sched.get_last_lr()[0], time.time() - t0)
            if step % args.eval_every == 0:
                metrics = evaluate(model, test_dl, device, args)
                logger.info("eval step %d %s", step, json.dumps(metrics))

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
