# SFT of a small code model on an instruction set, with a held-out perplexity eval
# every N steps. Plain DDP, bf16 autocast.
#
# torchrun --standalone --nproc_per_node=4 10_ddp_sft_eval_ppl.py \
#     --model bigcode/starcoder2-3b --data ise-uiuc/Magicoder-Evol-Instruct-110K
import argparse
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def encode(ex, tok, max_len):
    prompt = PROMPT.format(instruction=ex["instruction"])
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(ex["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = (p + r)[:max_len]
    labels = ([-100] * len(p) + r)[:max_len]
    return {"input_ids": ids, "labels": labels}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), -100)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n] = torch.tensor(b["input_ids"])
        labels[i, :n] = torch.tensor(b["labels"])
        mask[i, :n] = 1
    return ids, labels, mask


def lm_loss(logits, labels, reduction="mean"):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                           labels[:, 1:].reshape(-1), ignore_index=-100, reduction=reduction)


def build_datasets(args, tok):
    raw = load_dataset(args.data, split="train")
    split = raw.train_test_split(test_size=2000, seed=0)
    fn = partial(encode, tok=tok, max_len=args.max_len)
    train_ds = split["train"].map(fn, remove_columns=split["train"].column_names, num_proc=8)
    eval_ds = split["test"].map(fn, remove_columns=split["test"].column_names)
    return train_ds, eval_ds


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    nll, ntok = 0.0, 0
    for ids, labels, mask in loader:
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        nll += lm_loss(logits, labels, reduction="sum").item()
        ntok += (labels[:, 1:] != -100).sum().item()
    totals = torch.tensor([nll, ntok], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    mean_nll = (totals[0] / totals[1]).item()
    return mean_nll, math.exp(mean_nll)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/starcoder2-3b")
    ap.add_argument("--data", default="ise-uiuc/Magicoder-Evol-Instruct-110K")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--out", default="out/sft_starcoder2")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token

    # rank 0 downloads / tokenizes first and fills the datasets cache, the rest reuse it
    if rank == 0:
        train_ds, eval_ds = build_datasets(args, tok)
    dist.barrier()
    if rank != 0:
        train_ds, eval_ds = build_datasets(args, tok)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    coll = partial(collate, pad_id=tok.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.bs, sampler=eval_sampler, collate_fn=coll,
                         num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    total = len(train_dl) // args.accum * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.03 * total), total)

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (ids, labels, mask) in enumerate(train_dl):
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            last = (i + 1) % args.accum == 0
            with (ddp.no_sync() if not last else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = ddp(input_ids=ids, attention_mask=mask).logits
                loss = lm_loss(logits, labels) / args.accum
                loss.backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"ep {epoch} step {step}/{total} loss {loss.item() * args.accum:.4f} "
                      f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                nll, ppl = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} nll {nll:.4f} ppl {ppl:.3f}", flush=True)
                    if nll < best:
                        best = nll
                        model.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
