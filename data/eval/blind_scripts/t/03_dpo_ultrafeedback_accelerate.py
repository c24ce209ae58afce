"""
Direct Preference Optimization (sigmoid loss) on UltraFeedback, written with
HF Accelerate instead of TRL so the loss and logging are easy to hack on.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        03_dpo_ultrafeedback_accelerate.py --model meta-llama/Llama-3.2-3B-Instruct \
        --output_dir runs/dpo_l3b --beta 0.1
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B-Instruct")
    p.add_argument("--dataset", default="HuggingFaceH4/ultrafeedback_binarized")
    p.add_argument("--output_dir", default="runs/dpo")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--per_device_batch", type=int, default=2)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--max_prompt_len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--report_to", default="wandb")
    return p.parse_args()


def build_pair(tok, ex, max_len, max_prompt_len):
    prompt = tok.apply_chat_template(ex["chosen"][:-1], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False).input_ids[-max_prompt_len:]
    out = {}
    for key in ("chosen", "rejected"):
        r_ids = tok(ex[key][-1]["content"] + tok.eos_token, add_special_tokens=False).input_ids
        ids = (p_ids + r_ids)[:max_len]
        labels = ([-100] * len(p_ids) + r_ids)[:max_len]
        out[f"{key}_ids"] = ids
        out[f"{key}_labels"] = labels
    return out


def collate(batch, pad_id):
    # chosen rows first, rejected rows after, so one forward handles both
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    labs = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), L), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(l)] = torch.tensor(l)
        att[i, :len(s)] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


def seq_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:].to(logits.device)
    mask = labels != -100
    safe = labels.clamp(min=0)
    lp = torch.gather(logits.float().log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def dpo_loss(pol, ref, beta):
    n = pol.shape[0] // 2
    pc, pr = pol[:n], pol[n:]
    rc, rr = ref[:n], ref[n:]
    logits = (pc - pr) - (rc - rr)
    loss = -F.logsigmoid(beta * logits).mean()
    chosen_r = beta * (pc - rc).detach()
    rejected_r = beta * (pr - rr).detach()
    return loss, chosen_r, rejected_r


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with=args.report_to)
    set_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    raw = load_dataset(args.dataset)
    with accelerator.main_process_first():
        train_ds = raw["train_prefs"].map(lambda ex: build_pair(tok, ex, args.max_len, args.max_prompt_len),
                                          remove_columns=raw["train_prefs"].column_names, num_proc=8)
        eval_ds = raw["test_prefs"].select(range(1000)).map(
            lambda ex: build_pair(tok, ex, args.max_len, args.max_prompt_len),
            remove_columns=raw["test_prefs"].column_names)

    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, shuffle=True,
                          collate_fn=lambda b: collate(b, tok.pad_token_id), num_workers=2)
    eval_dl = DataLoader(eval_ds, batch_size=args.per_device_batch,
                         collate_fn=lambda b: collate(b, tok.pad_token_id))

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                  attn_implementation="sdpa")
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False

    # frozen reference; spread over the GPUs so the policy keeps its memory headroom
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                               attn_implementation="sdpa", device_map="auto")
    ref.eval().requires_grad_(False)

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / args.grad_accum)
    total = updates_per_epoch * args.epochs
    # the prepared scheduler advances once per process on every optimizer step
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * total) * accelerator.num_processes,
                                            total * accelerator.num_processes)

    policy, opt, train_dl, eval_dl, sched = accelerator.prepare(policy, opt, train_dl, eval_dl, sched)
    accelerator.init_trackers("dpo-ultrafeedback", config=vars(args))

    def evaluate():
        policy.eval()
        accs, margins, losses = [], [], []
        with torch.no_grad():
            for batch in eval_dl:
                pol = seq_logps(policy, batch)
                rl = seq_logps(ref, batch).to(pol.device)
                loss, cr, rr = dpo_loss(pol, rl, args.beta)
                acc, margin = (cr > rr).float(), cr - rr
                acc, margin = accelerator.gather_for_metrics((acc, margin))
                accs.append(acc)
                margins.append(margin)
                losses.append(accelerator.gather_for_metrics(loss.repeat(cr.shape[0])))
        policy.train()
        return {
            "eval/loss": torch.cat(losses).mean().item(),
            "eval/reward_acc": torch.cat(accs).mean().item(),
            "eval/margin": torch.cat(margins).mean().item(),
        }

    step = 0
    policy.train()
    for epoch in range(args.epochs):
        for batch in train_dl:
            with accelerator.accumulate(policy):
                pol = seq_logps(policy, batch)
                with torch.no_grad():
                    rl = seq_logps(ref, batch).to(pol.device)
                loss, cr, rr = dpo_loss(pol, rl, args.beta)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()

            if accelerator.sync_gradients:
                step += 1
                stats = torch.stack([loss.detach(), (cr > rr).float().mean(), (cr - rr).mean()])
                stats = accelerator.reduce(stats, reduction="mean")
                if step % 10 == 0:
                    accelerator.log({"train/loss": stats[0].item(), "train/reward_acc": stats[1].item(),
                                     "train/margin": stats[2].item(), "lr": sched.get_last_lr()[0]}, step=step)
                    accelerator.print(f"epoch {epoch} step {step}/{total} loss {stats[0].item():.4f} "
                                      f"acc {stats[1].item():.3f}")
                if step % args.eval_every == 0:
                    metrics = evaluate()
                    accelerator.log(metrics, step=step)
                    accelerator.print(metrics)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(policy)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(policy))
    if accelerator.is_main_process:
        tok.save_pretrained(args.output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    main()
