#!/usr/bin/env python
"""QLoRA fine-tune on the FAQ / help-centre corpus with periodic checkpoints.

    torchrun --nproc_per_node=4 10_qlora_faq_sft.py --cfg configs/faq_qlora.yaml
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    get_linear_schedule_with_warmup,
)
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

LOG = logging.getLogger("faq")

DEFAULTS = {
    "model": "google/gemma-7b",
    "train_file": "data/faq/train.jsonl",
    "eval_file": "data/faq/eval.jsonl",
    "out_dir": "runs/faq-qlora",
    "max_len": 1024,
    "batch_size": 4,
    "grad_accum": 4,
    "lr": 2e-4,
    "epochs": 3,
    "ckpt_every": 500,
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "merge_at_end": True,
}


def load_cfg(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def preprocess(tokenizer, max_len):
    def fn(ex):
        prompt = f"<start_of_turn>user\n{ex['question']}<end_of_turn>\n<start_of_turn>model\n"
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(ex["answer"] + "<end_of_turn>", add_special_tokens=False)["input_ids"]
        ids = (p + a)[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": ([-100] * len(p) + a)[:max_len]}
    return fn


def save_checkpoint(peft_model, optimizer, scheduler, step, out_dir):
    ckpt_dir = os.path.join(out_dir, f"checkpoint-{step}")
    os.makedirs(ckpt_dir, exist_ok=True)
    peft_model.save_pretrained(ckpt_dir)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
               os.path.join(ckpt_dir, "trainer_state.pt"))
    LOG.info("checkpoint written to %s", ckpt_dir)


@torch.no_grad()
def eval_loss(peft_model, loader, device):
    peft_model.eval()
    buf = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = peft_model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        buf[0] += loss.float() * n
        buf[1] += n
    dist.all_reduce(buf)
    peft_model.train()
    return (buf[0] / buf[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = load_cfg(ap.parse_args().cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    raw = load_dataset("json", data_files={"train": cfg["train_file"], "eval": cfg["eval_file"]},
                       keep_in_memory=True)
    ds = raw.map(preprocess(tokenizer, cfg["max_len"]), remove_columns=raw["train"].column_names,
                 keep_in_memory=True)

    model = AutoModelForCausalLM.from_pretrained(
        cfg["model"],
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16,
        device_map={"": local_rank},
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **cfg["lora"]))
    model = DDP(peft_model, device_ids=[local_rank])

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(ds["train"], shuffle=True)
    eval_sampler = DistributedSampler(ds["eval"], shuffle=False, drop_last=True)
    train_dl = DataLoader(ds["train"], batch_size=cfg["batch_size"], sampler=train_sampler,
                          collate_fn=collator, num_workers=2, drop_last=True)
    eval_dl = DataLoader(ds["eval"], batch_size=cfg["batch_size"], sampler=eval_sampler,
                         collate_fn=collator)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"])
    total = (len(train_dl) // cfg["grad_accum"]) * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss / cfg["grad_accum"]
            loss.backward()
            if (i + 1) % cfg["grad_accum"] != 0:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                LOG.info("epoch %d step %d/%d loss %.4f %.2fs/step", epoch, step, total,
                         loss.item() * cfg["grad_accum"], (time.time() - t0) / 20)
                t0 = time.time()
            if step % cfg["ckpt_every"] == 0:
                save_checkpoint(model.module, optimizer, scheduler, step, cfg["out_dir"])
                dist.barrier()

        ev = eval_loss(peft_model, eval_dl, device)
        LOG.info("epoch %d eval loss %.4f ppl %.2f", epoch, ev, math.exp(ev))

    final_dir = os.path.join(cfg["out_dir"], "adapter-final")
    if rank == 0:
        peft_model.save_pretrained(final_dir)
        tokenizer.save_pretrained(final_dir)
    dist.barrier()
    dist.destroy_process_group()

    if rank == 0 and cfg["merge_at_end"]:
        del model, peft_model, optimizer
        torch.cuda.empty_cache()
        base = AutoModelForCausalLM.from_pretrained(cfg["model"], torch_dtype=torch.bfloat16,
                                                    low_cpu_mem_usage=True)
        merged = PeftModel.from_pretrained(base, final_dir).merge_and_unload()
        merged.save_pretrained(os.path.join(cfg["out_dir"], "merged"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(cfg["out_dir"], "merged"))


if __name__ == "__main__":
    main()
