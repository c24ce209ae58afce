"""
Direct Preference Optimization of an SFT policy with Hugging Face Accelerate.

Data: JSONL with "prompt", "chosen", "rejected" (chosen/rejected are the
completions only). A frozen copy of the SFT model is the reference policy.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        14_dpo_policy_accelerate.py --model_name_or_path ./sft-llama-1b --train_file data/prefs.jsonl
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
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", default=None)
    p.add_argument("--output_dir", default="dpo-out")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--max_prompt_len", type=int, default=512)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--per_device_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-7)
    p.add_argument("--num_epochs", type=int, default=1)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--report_to", default="wandb")
    return p.parse_args()


def load_model(name):
    model = AutoModelForCausalLM.from_pretrained(
        name,
        torch_dtype=torch.bfloat16,
        device_map="auto",
        attn_implementation="sdpa",
    )
    model.config.use_cache = False
    return model


def build_features(tokenizer, max_prompt_len, max_len):
    def fn(ex):
        prompt_ids = tokenizer(ex["prompt"], add_special_tokens=True)["input_ids"][-max_prompt_len:]
        out = {}
        for key in ("chosen", "rejected"):
            comp = tokenizer(ex[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (prompt_ids + comp)[:max_len]
            labels = ([-100] * len(prompt_ids) + comp)[:max_len]
            out[f"{key}_input_ids"] = ids
            out[f"{key}_labels"] = labels
        return out
    return fn


def collate(batch, pad_id):
    seqs = [b["chosen_input_ids"] for b in batch] + [b["rejected_input_ids"] for b in batch]
    labs = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labs)):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(l)] = torch.tensor(l)
        attn[i, :len(s)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def sequence_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    safe = labels.masked_fill(~mask, 0)
    per_tok = torch.gather(logits.float().log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return (per_tok * mask).sum(-1)


def dpo_loss(policy_logps, ref_logps, beta):
    pc, pr = policy_logps.chunk(2)
    rc, rr = ref_logps.chunk(2)
    logits = beta * ((pc - rc) - (pr - rr))
    loss = -F.logsigmoid(logits).mean()
    chosen_reward = beta * (pc - rc).detach()
    rejected_reward = beta * (pr - rr).detach()
    return loss, chosen_reward, rejected_reward


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with=args.report_to if args.report_to != "none" else None)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    files = {"train": args.train_file}
    if args.eval_file:
        files["eval"] = args.eval_file
    raw = load_dataset("json", data_files=files)
    with accelerator.main_process_first():
        ds = raw.map(build_features(tokenizer, args.max_prompt_len, args.max_len),
                     remove_columns=raw["train"].column_names, num_proc=8)

    train_loader = DataLoader(ds["train"], batch_size=args.per_device_batch_size, shuffle=True,
                              collate_fn=lambda b: collate(b, tokenizer.pad_token_id), num_workers=2)
    eval_loader = None
    if "eval" in ds:
        eval_loader = DataLoader(ds["eval"], batch_size=args.per_device_batch_size,
                                 collate_fn=lambda b: collate(b, tokenizer.pad_token_id))

    policy = load_model(args.model_name_or_path)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = load_model(args.model_name_or_path)
    reference.eval()
    reference.requires_grad_(False)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_loader) / (args.gradient_accumulation_steps * accelerator.num_processes))
    total_steps = steps_per_epoch * args.num_epochs
    # the prepared scheduler advances once per process at every optimizer step
    scheduler = get_cosine_schedule_with_warmup(optimizer,
                                                num_warmup_steps=int(args.warmup_ratio * total_steps) * accelerator.num_processes,
                                                num_training_steps=total_steps * accelerator.num_processes)

    policy, optimizer, train_loader, scheduler = accelerator.prepare(policy, optimizer, train_loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)

    accelerator.init_trackers("dpo", config=vars(args))
    progress = tqdm(total=total_steps, disable=not accelerator.is_local_main_process)
    step = 0
    for epoch in range(args.num_epochs):
        policy.train()
        for batch in train_loader:
            with accelerator.accumulate(policy):
                with torch.no_grad():
                    ref_logps = sequence_logps(reference, batch)
                policy_logps = sequence_logps(policy, batch)
                loss, cr, rr = dpo_loss(policy_logps, ref_logps, args.beta)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                step += 1
                progress.update(1)
                if step % args.log_every == 0:
                    stats = accelerator.gather(torch.stack([loss.detach(), (cr > rr).float().mean(),
                                                            (cr - rr).mean()]).unsqueeze(0)).mean(0)
                    accelerator.log({"train/loss": stats[0].item(), "train/reward_acc": stats[1].item(),
                                     "train/margin": stats[2].item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        if eval_loader is not None:
            policy.eval()
            accs = []
            with torch.no_grad():
                for batch in eval_loader:
                    _, cr, rr = dpo_loss(sequence_logps(policy, batch), sequence_logps(reference, batch), args.beta)
                    accs.append(accelerator.gather_for_metrics((cr > rr).float()))
            acc = torch.cat(accs).mean().item()
            accelerator.print(f"epoch {epoch}: eval reward accuracy {acc:.4f}")
            accelerator.log({"eval/reward_acc": acc}, step=step)

        accelerator.wait_for_everyone()
        save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
        unwrapped = accelerator.unwrap_model(policy)
        unwrapped.save_pretrained(save_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save,
                                  state_dict=accelerator.get_state_dict(policy))
        if accelerator.is_main_process:
            tokenizer.save_pretrained(save_dir)

    accelerator.end_training()


if __name__ == "__main__":
    main()
