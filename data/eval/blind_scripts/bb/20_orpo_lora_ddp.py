"""ORPO (odds-ratio preference optimization) with LoRA, no reference model, torchrun + DDP.

    torchrun --nproc_per_node=8 20_orpo_lora_ddp.py --model meta-llama/Meta-Llama-3-8B \
        --dataset argilla/dpo-mix-7k --output_dir runs/l3-8b-orpo
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--dataset", default="argilla/dpo-mix-7k")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--bsz", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=8e-6)
    ap.add_argument("--orpo_lambda", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lora_r", type=int, default=16)
    return ap.parse_args()


def preprocess(ex, tok, max_len, max_prompt_len):
    prompt_msgs = ex["chosen"][:-1]
    prompt = tok.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"][-max_prompt_len:]
    row = {}
    for side in ("chosen", "rejected"):
        r_ids = tok(ex[side][-1]["content"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:max_len]
        row[f"{side}_ids"] = ids
        row[f"{side}_labels"] = ([-100] * len(p_ids) + r_ids)[:max_len]
    return row


def collate(batch, pad_id):
    rows = [(b["chosen_ids"], b["chosen_labels"]) for b in batch] + \
           [(b["rejected_ids"], b["rejected_labels"]) for b in batch]
    L = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


def orpo_loss(model, batch, lam):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    tok_logp = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    seq_logp = (tok_logp * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # mean log-prob per response token
    n = seq_logp.size(0) // 2
    lp_c, lp_r = seq_logp[:n], seq_logp[n:]
    nll = -(tok_logp[:n] * mask[:n]).sum() / mask[:n].sum().clamp(min=1)
    log_odds = (lp_c - lp_r) - (torch.log1p(-torch.exp(lp_c)) - torch.log1p(-torch.exp(lp_r)))
    ratio = F.logsigmoid(log_odds)
    loss = nll - lam * ratio.mean()
    return loss, nll.detach(), ratio.mean().detach(), (lp_c > lp_r).float().mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                             "{{ m['content'] }}<|eot_id|>{% endfor %}"
                             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                             "{% endif %}")

    if rank != 0:
        dist.barrier()
    ds = load_dataset(args.dataset)
    kw = {"tok": tok, "max_len": args.max_len, "max_prompt_len": args.max_prompt_len}
    train = ds["train"].map(preprocess, fn_kwargs=kw, remove_columns=ds["train"].column_names, num_proc=8)
    test = ds["test"].map(preprocess, fn_kwargs=kw, remove_columns=ds["test"].column_names)
    if rank == 0:
        dist.barrier()

    col = lambda b: collate(b, tok.pad_token_id)  # noqa: E731
    sampler = DistributedSampler(train, shuffle=True, seed=42)
    train_dl = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=col, num_workers=4,
                          drop_last=True)
    test_dl = DataLoader(test, batch_size=args.bsz, sampler=DistributedSampler(test, shuffle=False, drop_last=True),
                         collate_fn=col)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = (len(train_dl) // args.accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % args.accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, nll, ratio, acc = orpo_loss(model, batch, args.orpo_lambda)
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss, nll, ratio, acc = orpo_loss(model, batch, args.orpo_lambda)
                    (loss / args.accum).backward()
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                m = torch.stack([loss.detach().float(), nll.float(), ratio.float(), acc])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(json.dumps({"epoch": epoch, "step": step, "loss": round(m[0].item(), 4),
                                      "nll": round(m[1].item(), 4), "log_odds_ratio": round(m[2].item(), 4),
                                      "pref_acc": round(m[3].item(), 3), "lr": sched.get_last_lr()[0],
                                      "elapsed": round(time.time() - t0, 1)}), flush=True)

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for batch in test_dl:
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, _, _, acc = orpo_loss(model.module, batch, args.orpo_lambda)
                tot += torch.stack([loss.float(), acc, torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} eval loss {(tot[0] / tot[2]).item():.4f} pref_acc {(tot[1] / tot[2]).item():.3f}",
                  flush=True)
            model.module.save_pretrained(os.path.join(args.output_dir, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.output_dir, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
