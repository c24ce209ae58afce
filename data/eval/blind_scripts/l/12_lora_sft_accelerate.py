# LoRA SFT of Llama-3.1-8B-Instruct on an internal support-ticket dataset (jsonl).
# Custom accelerate loop so we can do our own packing + eval.
#
#   accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
#       12_lora_sft_accelerate.py --train data/tickets_train.jsonl --eval data/tickets_dev.jsonl
import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          get_cosine_schedule_with_warmup)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--out", default="out/lora_tickets")
    return p.parse_args()


def to_features(ex, tok, max_len):
    msgs = [{"role": "system", "content": "You are a support assistant for ACME Cloud."},
            {"role": "user", "content": ex["ticket"]}]
    prompt_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    answer_ids = tok(ex["resolution"] + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + answer_ids)[:max_len]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_len]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def main():
    args = parse()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, log_with="tensorboard",
                              project_dir=args.out)
    set_seed(1234)
    accelerator.init_trackers("lora_sft", config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"
    tok.padding_side = "right"

    with accelerator.main_process_first():
        raw = load_dataset("json", data_files={"train": args.train, "eval": args.eval})
        feats = raw.map(to_features, fn_kwargs={"tok": tok, "max_len": args.max_len},
                        remove_columns=raw["train"].column_names, num_proc=8)

    collator = DataCollatorForSeq2Seq(tok, padding="longest", pad_to_multiple_of=8,
                                      label_pad_token_id=-100)
    train_dl = DataLoader(feats["train"], batch_size=args.bs, shuffle=True, collate_fn=collator,
                          num_workers=4, drop_last=True)
    eval_dl = DataLoader(feats["eval"], batch_size=args.bs * 2, collate_fn=collator)

    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        torch_dtype=torch.bfloat16,
        attn_implementation="sdpa",
        device_map="auto",
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if accelerator.is_main_process:
        model.print_trainable_parameters()

    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                              weight_decay=0.0)
    updates_per_epoch = math.ceil(len(train_dl) / accelerator.num_processes / args.accum)
    total = updates_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, num_warmup_steps=int(0.05 * total) * accelerator.num_processes,
                                            num_training_steps=total * accelerator.num_processes)

    model, optim, train_dl, eval_dl, sched = accelerator.prepare(model, optim, train_dl,
                                                                 eval_dl, sched)

    gstep = 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad()
            if accelerator.sync_gradients:
                gstep += 1
                if gstep % 10 == 0:
                    l = accelerator.reduce(out.loss.detach(), reduction="mean")
                    accelerator.log({"train_loss": l.item(), "lr": sched.get_last_lr()[0]},
                                    step=gstep)
                    accelerator.print(f"epoch {epoch} step {gstep}/{total} loss {l.item():.4f}")

        model.eval()
        losses = []
        for batch in eval_dl:
            with torch.no_grad():
                out = model(**batch)
            losses.append(accelerator.gather_for_metrics(out.loss.detach().repeat(batch["input_ids"].size(0))))
        eval_loss = torch.cat(losses).mean().item()
        accelerator.log({"eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss)}, step=gstep)
        accelerator.print(f"epoch {epoch} eval_loss {eval_loss:.4f}")

        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(os.path.join(args.out, f"adapter_ep{epoch}"),
                                  is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)

    accelerator.end_training()


if __name__ == "__main__":
    main()
