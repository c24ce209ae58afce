#!/usr/bin/env python
"""LoRA fine-tuning of an LLM for EN->DE product-catalogue translation.

Config keys: model, train_file, test_file, output_dir, max_len, batch_size, eval_batch_size,
lr, epochs, warmup_ratio, lora_r, lora_alpha, lora_targets, max_new_tokens, seed.

    torchrun --nproc_per_node=8 14_lora_translation.py --config configs/mt_lora.yaml
"""
import argparse
import functools
import json
import logging
import math
import os
from types import SimpleNamespace

import sacrebleu
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from peft import LoraConfig, get_peft_model

logger = logging.getLogger("mt-lora")
PROMPT = "Translate the following product description from English to German.\nEnglish: {src}\nGerman:"


class ParallelDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, with_target=True):
        self.items = []
        for line in open(path, encoding="utf-8"):
            ex = json.loads(line)
            p = tokenizer(PROMPT.format(src=ex["en"]))["input_ids"]
            if with_target:
                t = tokenizer(" " + ex["de"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                self.items.append(((p + t)[:max_len], ([-100] * len(p) + t)[:max_len]))
            else:
                self.items.append((p, ex["de"]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def train_collate(batch, pad_id):
    L = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id)
    lab = torch.full((len(batch), L), -100)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


def gen_collate(batch, pad_id):
    # left padding for generation
    L = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), L), pad_id)
    att = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, _) in enumerate(batch):
        ids[i, L - len(x):], att[i, L - len(x):] = torch.tensor(x), 1
    return ids, att, [ref for _, ref in batch]


@torch.no_grad()
def bleu_eval(peft_model, tokenizer, loader, device, max_new_tokens):
    peft_model.eval()
    hyps, refs = [], []
    for ids, att, ref in loader:
        out = peft_model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                  max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
        hyps += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        refs += ref
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (hyps, refs))
    peft_model.train()
    all_h = [h.strip() for hs, _ in gathered for h in hs]
    all_r = [r for _, rs in gathered for r in rs]
    return sacrebleu.corpus_bleu(all_h, [all_r]).score


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    with open(ap.parse_args().config) as f:
        cfg = SimpleNamespace(**yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.model)
    tok.pad_token = tok.pad_token or tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.05,
                                             target_modules=cfg.lora_targets, task_type="CAUSAL_LM"))
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_ds = ParallelDataset(cfg.train_file, tok, cfg.max_len)
    test_ds = ParallelDataset(cfg.test_file, tok, cfg.max_len, with_target=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=2,
                          collate_fn=functools.partial(train_collate, pad_id=tok.pad_token_id), drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=cfg.eval_batch_size, sampler=test_sampler,
                         collate_fn=functools.partial(gen_collate, pad_id=tok.pad_token_id))

    optimizer = torch.optim.AdamW([p for p in ddp_model.parameters() if p.requires_grad],
                                  lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = len(train_ds) // cfg.batch_size
    total_steps = steps_per_epoch * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)

    logger.info("train examples %d, steps/epoch %d, total %d", len(train_ds), steps_per_epoch, total_steps)
    best = -1.0
    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = ddp_model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0])

        bleu = bleu_eval(model, tok, test_dl, device, cfg.max_new_tokens)
        logger.info("epoch %d test BLEU %.2f", epoch, bleu)
        if bleu > best:
            best = bleu
            if rank == 0:
                model.save_pretrained(os.path.join(cfg.output_dir, "best"))
                tok.save_pretrained(os.path.join(cfg.output_dir, "best"))
                with open(os.path.join(cfg.output_dir, "best", "bleu.json"), "w") as f:
                    json.dump({"epoch": epoch, "bleu": bleu}, f)
            dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(cfg.output_dir, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
