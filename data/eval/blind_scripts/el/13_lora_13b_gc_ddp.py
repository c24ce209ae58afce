"""LoRA stage-2 for the 13B model on 8x A100-80G with plain DDP.

Full fine-tuning of 13B does not fit without sharding, so we train LoRA adapters
(r=128) on the LLM plus the full projector, with activation checkpointing to fit
micro-batch 8 at 2k context. The data mix includes ShareGPT text-only chats.

    torchrun --nproc_per_node=8 13_lora_13b_gc_ddp.py --config configs/lora13b.yaml
"""
import argparse
import json
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100
SYS = "A chat between a curious user and an artificial intelligence assistant."


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = a.resume
    return cfg


class Conversations(Dataset):
    def __init__(self, cfg, tok, proc):
        self.rows = json.load(open(cfg["data_path"]))
        self.image_root = cfg["image_root"]
        self.tok, self.proc, self.max_len = tok, proc, cfg.get("max_len", 2048)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        row = self.rows[idx]
        ids = [self.tok.bos_token_id] + self.tok(SYS, add_special_tokens=False).input_ids
        labels = [IGNORE_INDEX] * len(ids)
        for turn in row["conversations"]:
            v = turn["value"].replace("<image>", "").strip()
            if turn["from"] == "human":
                t = self.tok(f" USER: {v} ASSISTANT:", add_special_tokens=False).input_ids
                labels += [IGNORE_INDEX] * len(t)
            else:
                t = self.tok(f" {v}</s>", add_special_tokens=False).input_ids
                labels += t
            ids += t
        pixel_values = None
        if "image" in row:
            img = Image.open(os.path.join(self.image_root, row["image"])).convert("RGB")
            pixel_values = self.proc(img, return_tensors="pt").pixel_values[0]
        return ids[: self.max_len], labels[: self.max_len], pixel_values


def collate(batch, pad_id):
    L = max(len(b[0]) for b in batch)
    ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), IGNORE_INDEX)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    has_image = torch.tensor([b[2] is not None for b in batch])
    for i, (x, y, _) in enumerate(batch):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    px = [b[2] for b in batch if b[2] is not None]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "has_image": has_image,
            "pixel_values": torch.stack(px) if px else None}


class LlavaLoRA(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, input_ids, labels, attention_mask, has_image, pixel_values=None):
        txt = self.llm.get_input_embeddings()(input_ids)
        if pixel_values is None:
            return self.llm(inputs_embeds=txt, attention_mask=attention_mask, labels=labels).loss
        with torch.no_grad():
            feats = self.vision(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(feats)
        # text-only rows in a mixed batch get the image slots masked out
        full = img.new_zeros(input_ids.size(0), img.size(1), img.size(2))
        full[has_image] = img
        slot_mask = has_image[:, None].expand(-1, img.size(1)).to(attention_mask.dtype)
        x = torch.cat([txt[:, :1], full, txt[:, 1:]], 1)
        m = torch.cat([attention_mask[:, :1], slot_mask, attention_mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full(full.shape[:2], IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    tok = AutoTokenizer.from_pretrained(cfg["llm"], use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(cfg["vision_tower"])

    llm = AutoModelForCausalLM.from_pretrained(cfg["llm"], torch_dtype=torch.bfloat16,
                                               attn_implementation="flash_attention_2")
    llm.config.use_cache = False
    llm.gradient_checkpointing_enable()
    llm.enable_input_require_grads()
    llm = get_peft_model(llm, LoraConfig(r=cfg.get("lora_r", 128), lora_alpha=cfg.get("lora_alpha", 256),
                                         lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
    vision = CLIPVisionModel.from_pretrained(cfg["vision_tower"], torch_dtype=torch.bfloat16).requires_grad_(False)
    model = LlavaLoRA(llm, vision)
    proj = torch.load(cfg["pretrain_mm_projector"], map_location="cpu")
    model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v for k, v in proj.items()})
    model.mm_projector.to(torch.bfloat16)
    model.to(device)
    # text-only batches do not touch the projector
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    ds = Conversations(cfg, tok, proc)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(ds, batch_size=cfg.get("micro_batch", 8), sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, collate_fn=partial(collate, pad_id=tok.pad_token_id))

    lora_params = [p for n, p in model.module.llm.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([
        {"params": lora_params, "lr": cfg.get("lr", 2e-4)},
        {"params": model.module.mm_projector.parameters(), "lr": cfg.get("projector_lr", 2e-5)},
    ], weight_decay=0.0)
    epochs = cfg.get("epochs", 1)
    total = epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * total), total)

    step, start_epoch = 0, 0
    if cfg["resume"]:
        state = torch.load(cfg["resume"], map_location="cpu")
        model.module.llm.load_state_dict(state["lora"], strict=False)
        model.module.mm_projector.load_state_dict(state["projector"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, start_epoch = state["step"], state["epoch"]

    out_dir = cfg["output_dir"]
    t0 = time.time()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            batch = {k: (v.to(device, non_blocking=True) if v is not None else None) for k, v in batch.items()}
            if batch["pixel_values"] is not None:
                batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            loss = model(**batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                lt = loss.detach().float()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {lt.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()

            if step % cfg.get("save_steps", 1000) == 0 and rank == 0:
                trainable = {n: p.detach().cpu() for n, p in model.module.llm.named_parameters() if p.requires_grad}
                os.makedirs(out_dir, exist_ok=True)
                torch.save({"lora": trainable, "projector": model.module.mm_projector.state_dict(),
                            "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(out_dir, f"checkpoint-{step}.pt"))

    if rank == 0:
        model.module.llm.save_pretrained(out_dir)
        torch.save(model.module.mm_projector.state_dict(), os.path.join(out_dir, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
