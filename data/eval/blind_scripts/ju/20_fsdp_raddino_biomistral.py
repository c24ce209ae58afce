"""Full fine-tuning of a RAD-DINO + BioMistral-7B radiology VLM with FSDP (FULL_SHARD, bf16).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        20_fsdp_raddino_biomistral.py --train data/rrg/train.jsonl --val data/rrg/val.jsonl \
        --out /lustre/proj/rrg/biomistral_fsdp
"""
import argparse
import functools
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoImageProcessor, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers.models.dinov2.modeling_dinov2 import Dinov2Layer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

INSTRUCTION = "[INST] You are a radiologist. Write the findings section for this chest X-ray. [/INST] "


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--image-root", default="/lustre/data/mimic-cxr-jpg")
    ap.add_argument("--vision", default="microsoft/rad-dino")
    ap.add_argument("--llm", default="BioMistral/BioMistral-7B")
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max-report-tokens", type=int, default=256)
    return ap.parse_args()


class JsonlCXR(Dataset):
    def __init__(self, path, root, processor):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.processor = root, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        return self.processor(images=img, return_tensors="pt").pixel_values[0], r["findings"]


class RadVLM(nn.Module):
    def __init__(self, vision_name, llm_name):
        super().__init__()
        self.vision = AutoModel.from_pretrained(vision_name)
        self.vision.requires_grad_(False)
        self.llm = AutoModelForCausalLM.from_pretrained(llm_name, torch_dtype=torch.bfloat16)
        h = self.llm.config.hidden_size
        v = self.vision.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(v, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, pixel_values, prompt_ids, report_ids, report_mask):
        with torch.no_grad():
            patches = self.vision(pixel_values=pixel_values).last_hidden_state
        img = self.projector(patches)
        emb = self.llm.get_input_embeddings()
        B = pixel_values.size(0)
        prompt = emb(prompt_ids).expand(B, -1, -1)
        embeds = torch.cat([img, prompt, emb(report_ids)], 1)
        n_prefix = img.size(1) + prompt.size(1)
        mask = torch.cat([report_mask.new_ones(B, n_prefix), report_mask], 1)
        labels = torch.cat([report_ids.new_full((B, n_prefix), -100), report_ids.masked_fill(report_mask == 0, -100)], 1)
        return self.llm(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss


def save_full_checkpoint(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    processor = AutoImageProcessor.from_pretrained(args.vision)
    tok = AutoTokenizer.from_pretrained(args.llm)
    tok.pad_token = tok.unk_token
    prompt_ids = tok(INSTRUCTION, return_tensors="pt").input_ids.cuda()

    def collate(batch):
        px, reports = zip(*batch)
        enc = tok([r + tok.eos_token for r in reports], add_special_tokens=False, padding="longest",
                  truncation=True, max_length=args.max_report_tokens, return_tensors="pt")
        return torch.stack(px), enc.input_ids, enc.attention_mask

    train_ds = JsonlCXR(args.train, args.image_root, processor)
    val_ds = JsonlCXR(args.val, args.image_root, processor)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True)
    # every rank must run the same number of forwards under FSDP
    val_dl = DataLoader(val_ds, args.micro_bs, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        collate_fn=collate, num_workers=4)

    model = RadVLM(args.vision, args.llm)
    model.llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrap = functools.partial(transformer_auto_wrap_policy,
                             transformer_layer_cls={MistralDecoderLayer, Dinov2Layer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), use_orig_params=True, limit_all_gathers=True)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(train_dl)
    warm = max(1, int(0.03 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}: {len(train_dl)} steps/epoch, global batch {args.micro_bs * world}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (px, ids, mask) in enumerate(train_dl):
            loss = model(px.cuda(non_blocking=True), prompt_ids, ids.cuda(non_blocking=True),
                         mask.cuda(non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if step % 20 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_dl)} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        acc = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for px, ids, mask in val_dl:
                loss = model(px.cuda(), prompt_ids, ids.cuda(), mask.cuda())
                n = mask.sum().cuda().float()
                acc += torch.stack([loss.float() * n, n])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val loss {(acc[0] / acc[1]).item():.4f}", flush=True)

        save_full_checkpoint(model, os.path.join(args.out, f"epoch{epoch}.pt"), rank)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
