"""LoRA SFT of Gemma-2-9B on a mixture of instruction datasets (DDP, bf16).

Tokenisation of the full mixture takes ~15 min, so the tokenised samples are cached
under --cache_dir keyed by tokenizer + data files + max_len.

    torchrun --nproc_per_node=8 07_gemma_lora_tokcache.py --data data/mix/*.jsonl --cache_dir /scratch/tokcache
"""
import argparse
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger("sft")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/gemma-2-9b")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--cache_dir", default=".tokcache")
    ap.add_argument("--out", default="outputs/gemma2-9b-lora")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_frac", type=float, default=0.005)
    ap.add_argument("--eval_steps", type=int, default=200)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


def fingerprint(tokenizer, files, max_len):
    h = hashlib.sha1()
    h.update(tokenizer.name_or_path.encode())
    h.update(str(len(tokenizer)).encode())
    h.update(str(max_len).encode())
    for f in sorted(files):
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def tokenize_record(rec, tok, max_len):
    msgs = rec["messages"]
    # gemma has no system role; fold a system prompt into the first user turn
    if msgs and msgs[0]["role"] == "system":
        sys_msg = msgs[0]["content"]
        msgs = [{"role": "user", "content": sys_msg + "\n\n" + msgs[1]["content"]}] + msgs[2:]
    input_ids, labels = [], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = tok.apply_chat_template(msgs[:i], add_generation_prompt=True)
        upto = tok.apply_chat_template(msgs[: i + 1])
        labels += [-100] * (len(prefix) - len(labels)) + upto[len(prefix):]
        input_ids = upto
    if not input_ids:
        return None
    return {"input_ids": input_ids[:max_len], "labels": labels[:max_len]}


def load_or_build(args, tok, rank):
    key = fingerprint(tok, args.data, args.max_len)
    cache_path = os.path.join(args.cache_dir, f"sft-{key}.pt")
    if os.path.exists(cache_path):
        samples = torch.load(cache_path)
        log.info("loaded %d cached samples from %s", len(samples), cache_path)
    else:
        samples = []
        for path in args.data:
            with open(path) as f:
                for line in tqdm(f, desc=os.path.basename(path), disable=rank != 0):
                    ex = tokenize_record(json.loads(line), tok, args.max_len)
                    if ex is not None and any(l != -100 for l in ex["labels"]):
                        samples.append(ex)
        os.makedirs(args.cache_dir, exist_ok=True)
        torch.save(samples, cache_path)
        log.info("tokenised %d samples -> %s", len(samples), cache_path)
    return samples


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), self.pad_id)
        lab = torch.full((len(batch), L), -100)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            lab[i, :n] = torch.tensor(b["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum = torch.zeros((), device=device)
    tok_sum = torch.zeros((), device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        loss_sum += torch.nn.functional.cross_entropy(
            shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
            ignore_index=-100, reduction="sum")
        tok_sum += (shift_labels != -100).sum()
    dist.all_reduce(loss_sum)
    dist.all_reduce(tok_sum)
    model.train()
    return (loss_sum / tok_sum).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    samples = load_or_build(args, tok, rank)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(samples), generator=g).tolist()
    n_eval = max(64, int(len(samples) * args.eval_frac))
    eval_set = [samples[i] for i in perm[:n_eval]]
    train_set = [samples[i] for i in perm[n_eval:]]

    collate = Collator(tok.pad_token_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    eval_sampler = DistributedSampler(eval_set, shuffle=False)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                          num_workers=2, drop_last=True)
    eval_dl = DataLoader(eval_set, batch_size=args.bs, sampler=eval_sampler, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="eager")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=2 * args.r, lora_dropout=0.05,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    updates = args.epochs * len(train_dl) // args.accum
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * updates), updates)
    log.info("samples train=%d eval=%d updates=%d", len(train_set), len(eval_set), updates)

    upd = 0
    t0 = time.time()
    for ep in range(args.epochs):
        train_sampler.set_epoch(ep)
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            (loss / args.accum).backward()
            if (it + 1) % args.accum:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1
            if upd % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("ep %d upd %d/%d loss %.4f lr %.2e (%.1fs)", ep, upd, updates, l.item(),
                         sched.get_last_lr()[0], time.time() - t0)
            if upd % args.eval_steps == 0:
                ev = evaluate(model, eval_dl, device)
                log.info("eval loss %.4f at upd %d", ev, upd)
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.out, f"upd{upd}"))
                dist.barrier()

    ev = evaluate(model, eval_dl, device)
    log.info("final eval loss %.4f", ev)
    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
