# SFT of StarCoder2-7B on the internal code-review-comment dataset (diff -> review comment).
#
# Launched as a PyTorchJob (2 pods x 8 H100). Each pod runs accelerate with the FSDP config
# checked into configs/fsdp_full_shard.yaml (FULL_SHARD, auto-wrap by Starcoder2DecoderLayer,
# bf16, SHARDED_STATE_DICT, use_orig_params):
#
#   accelerate launch --config_file configs/fsdp_full_shard.yaml \
#       --num_machines 2 --num_processes 16 --machine_rank $PET_NODE_RANK \
#       --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
#       code_review_sft.py --data /mnt/shared/review_sft/*.jsonl \
#       --cache-dir /mnt/shared/cache/review_sft --output-dir /mnt/shared/runs/sc2-7b-review
#
# /mnt/shared is a ReadWriteMany Filestore volume mounted in both pods.
import argparse
import glob
import hashlib
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset, load_from_disk
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

PROMPT = "<review>\n### Diff\n{diff}\n### Comment\n"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/starcoder2-7b")
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=400)
    return ap.parse_args()


def tokenize_fn(tok, max_len):
    def fn(batch):
        out = {"input_ids": [], "labels": []}
        for diff, comment in zip(batch["diff"], batch["comment"]):
            p = tok(PROMPT.format(diff=diff), add_special_tokens=False)["input_ids"]
            c = tok(comment, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            p = p[-(max_len - len(c)):] if len(p) + len(c) > max_len else p
            ids = (p + c)[:max_len]
            out["input_ids"].append(ids)
            out["labels"].append(([-100] * len(p) + c)[:max_len])
        return out
    return fn


def get_tokenized(args, tok):
    files = sorted(glob.glob(args.data))
    key = hashlib.md5(("|".join(files) + f"|{args.model}|{args.max_len}").encode()).hexdigest()[:12]
    cache_path = os.path.join(args.cache_dir, f"tokenized-{key}")
    if os.path.isdir(cache_path):
        return load_from_disk(cache_path)
    raw = load_dataset("json", data_files=files, split="train")
    raw = raw.filter(lambda ex: len(ex["comment"].strip()) > 0, num_proc=16)
    ds = raw.map(tokenize_fn(tok, args.max_len), batched=True, num_proc=16, remove_columns=raw.column_names)
    ds = ds.train_test_split(test_size=2000, seed=0)
    ds.save_to_disk(cache_path)
    return ds


def collate(pad_id):
    def fn(rows):
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), n), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            labels[i, : len(r["labels"])] = torch.tensor(r["labels"])
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad_id).long()}
    return fn


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb")
    set_seed(42)
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    ds = get_tokenized(args, tok)
    train_dl = DataLoader(ds["train"], batch_size=args.micro_bs, shuffle=True, collate_fn=collate(tok.pad_token_id),
                          num_workers=4, drop_last=True)
    eval_dl = DataLoader(ds["test"], batch_size=args.micro_bs, collate_fn=collate(tok.pad_token_id))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = accelerator.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    # counted on the un-sharded loader: accelerate steps a prepared scheduler num_processes times per update
    steps = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * steps), steps)
    opt, train_dl, eval_dl, sched = accelerator.prepare(opt, train_dl, eval_dl, sched)

    accelerator.init_trackers("code-review-sft", config=vars(args),
                              init_kwargs={"wandb": {"name": os.path.basename(args.output_dir)}})

    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    step, start_epoch, skip = 0, 0, 0
    if os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        last = sorted(os.listdir(ckpt_root), key=lambda d: int(d.split("_")[-1]))[-1]
        accelerator.load_state(os.path.join(ckpt_root, last))
        step = int(last.split("_")[-1])
        start_epoch = (step * args.grad_accum) // len(train_dl)
        skip = (step * args.grad_accum) % len(train_dl)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        dl = accelerator.skip_first_batches(train_dl, skip) if epoch == start_epoch and skip else train_dl
        for batch in dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % 10 == 0:
                accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item(),
                                 "train/lr": sched.get_last_lr()[0]}, step=step)
            if step % args.ckpt_every == 0:
                accelerator.save_state(os.path.join(ckpt_root, f"step_{step}"))

        model.eval()
        losses = []
        with torch.no_grad():
            for batch in eval_dl:
                l = model(**batch).loss
                losses.append(accelerator.gather_for_metrics(l.detach().repeat(batch["input_ids"].size(0))))
        model.train()
        eval_loss = torch.cat(losses).mean().item()
        accelerator.log({"eval/loss": eval_loss, "eval/ppl": math.exp(eval_loss)}, step=step)
        accelerator.print(f"epoch {epoch}: eval loss {eval_loss:.4f}")

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.output_dir, "final"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
