# DPO on UltraFeedback-binarized with a plain accelerate loop (no TRL trainer).
# accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
#     03_dpo_accelerate_wandb.py --model_name HuggingFaceTB/SmolLM2-1.7B-Instruct
import argparse
import math
import os

import torch
import torch.nn.functional as F
import wandb
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

MAX_LEN = 1024
MAX_PROMPT = 512


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="HuggingFaceTB/SmolLM2-1.7B-Instruct")
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrafeedback_binarized")
    ap.add_argument("--output_dir", default="out/dpo")
    ap.add_argument("--per_device_bs", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--log_every", type=int, default=10)
    ap.add_argument("--wandb_project", default="dpo-smol")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def tokenize_pair(example, tok):
    prompt = tok.apply_chat_template(example["chosen"][:-1], tokenize=False,
                                     add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"][-MAX_PROMPT:]
    out = {}
    for key in ("chosen", "rejected"):
        resp = example[key][-1]["content"] + tok.eos_token
        r_ids = tok(resp, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:MAX_LEN]
        labels = ([-100] * len(p_ids) + r_ids)[:MAX_LEN]
        out[f"{key}_input_ids"] = ids
        out[f"{key}_labels"] = labels
    return out


def make_collate(pad_id):
    def collate(batch):
        seqs, labs = [], []
        for ex in batch:
            seqs += [ex["chosen_input_ids"], ex["rejected_input_ids"]]
            labs += [ex["chosen_labels"], ex["rejected_labels"]]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        lab = torch.full((len(seqs), L), -100, dtype=torch.long)
        att = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, labs)):
            ids[i, : len(s)] = torch.tensor(s)
            lab[i, : len(l)] = torch.tensor(l)
            att[i, : len(s)] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return collate


def seq_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    safe = labels.masked_fill(~mask, 0)
    lp = torch.gather(logits.log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def main():
    args = get_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)

    if accelerator.is_main_process:
        wandb.init(project=args.wandb_project, config=vars(args),
                   name=f"dpo-b{args.beta}-lr{args.lr}")

    tok = AutoTokenizer.from_pretrained(args.model_name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    raw = load_dataset(args.dataset, split="train_prefs")
    with accelerator.main_process_first():
        ds = raw.map(tokenize_pair, fn_kwargs={"tok": tok}, remove_columns=raw.column_names,
                     num_proc=16, desc="tokenize")
    loader = DataLoader(ds, batch_size=args.per_device_bs, shuffle=True,
                        collate_fn=make_collate(tok.pad_token_id), num_workers=2, drop_last=True)

    policy = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = AutoModelForCausalLM.from_pretrained(args.model_name, torch_dtype=torch.bfloat16)
    ref.requires_grad_(False).eval()

    optim = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.grad_accum)
    total = steps_per_epoch * args.epochs
    # the prepared scheduler is stepped once per process on every optimizer step
    sched = get_cosine_schedule_with_warmup(
        optim,
        num_warmup_steps=int(args.warmup_ratio * total) * accelerator.num_processes,
        num_training_steps=total * accelerator.num_processes,
    )

    policy, optim, loader, sched = accelerator.prepare(policy, optim, loader, sched)
    ref = ref.to(accelerator.device)

    global_step = 0
    for epoch in range(args.epochs):
        policy.train()
        for batch in loader:
            with accelerator.accumulate(policy):
                pi = seq_logps(policy, batch)
                with torch.no_grad():
                    rf = seq_logps(ref, batch)
                pi_c, pi_r = pi[0::2], pi[1::2]
                rf_c, rf_r = rf[0::2], rf[1::2]
                logits = args.beta * ((pi_c - rf_c) - (pi_r - rf_r))
                loss = -F.logsigmoid(logits).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(policy.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad()

            if accelerator.sync_gradients:
                global_step += 1
                acc = (logits > 0).float().mean()
                margin = logits.detach().mean() / args.beta
                stats = accelerator.reduce(torch.stack([loss.detach(), acc, margin]),
                                           reduction="mean")
                if global_step % args.log_every == 0:
                    wandb.log({"train/loss": stats[0].item(), "train/reward_acc": stats[1].item(),
                               "train/margin": stats[2].item(),
                               "train/lr": sched.get_last_lr()[0], "epoch": epoch},
                              step=global_step)
                    accelerator.print(f"step {global_step}/{total} loss {stats[0]:.4f} "
                                      f"acc {stats[1]:.3f}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(policy)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(policy))
    if accelerator.is_main_process:
        tok.save_pretrained(args.output_dir)
        wandb.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
