"""LLaVA stage-1 alignment: train only the vision->language MLP projector on
LCS-558K image-caption pairs. CLIP ViT-L/336 and Vicuna-13B are frozen but
sharded with FSDP so that 13B fits alongside large batches.

    torchrun --nproc_per_node=8 20_llava_stage1_projector.py --data /data/LLaVA-Pretrain
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

N_PATCHES = 576


class AlignmentModel(nn.Module):
    def __init__(self, vision_name, llm_name):
        super().__init__()
        self.vision = CLIPVisionModel.from_pretrained(vision_name)
        self.llm = AutoModelForCausalLM.from_pretrained(llm_name, torch_dtype=torch.float32)
        vd, ld = self.vision.config.hidden_size, self.llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vd, ld), nn.GELU(), nn.Linear(ld, ld))

    def forward(self, pixel_values, input_ids, attention_mask, labels):
        with torch.no_grad():
            feats = self.vision(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.projector(feats)
        txt = self.llm.get_input_embeddings()(input_ids)
        embeds = torch.cat([txt[:, :1], img, txt[:, 1:]], dim=1)  # BOS, image, caption
        ones = attention_mask.new_ones(attention_mask.shape[0], img.shape[1])
        attn = torch.cat([attention_mask[:, :1], ones, attention_mask[:, 1:]], dim=1)
        ign = labels.new_full((labels.shape[0], img.shape[1]), -100)
        lab = torch.cat([labels[:, :1], ign, labels[:, 1:]], dim=1)
        return self.llm(inputs_embeds=embeds, attention_mask=attn, labels=lab).loss


class CaptionPairs(Dataset):
    def __init__(self, root, tokenizer, processor, max_len=128):
        with open(os.path.join(root, "blip_laion_cc_sbu_558k.json")) as f:
            self.rows = json.load(f)
        self.img_dir = os.path.join(root, "images")
        self.tok, self.proc, self.max_len = tokenizer, processor, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.img_dir, r["image"])).convert("RGB")
        pix = self.proc(images=img, return_tensors="pt").pixel_values[0]
        caption = r["conversations"][1]["value"].strip()
        ids = self.tok(caption + self.tok.eos_token, max_length=self.max_len, truncation=True).input_ids
        return pix, torch.tensor(ids)


def collate(batch, pad_id):
    pix, ids = zip(*batch)
    L = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), L), pad_id)
    attn = torch.zeros((len(ids), L), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = x
        attn[i, :len(x)] = 1
    labels = input_ids.masked_fill(attn == 0, -100)
    labels[:, 0] = -100  # BOS
    return torch.stack(pix), input_ids, attn, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--llm", default="lmsys/vicuna-13b-v1.5")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="checkpoints/llava-13b-stage1")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--val-size", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision)

    model = AlignmentModel(args.vision, args.llm)
    model.vision.requires_grad_(False)
    model.llm.requires_grad_(False)
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer, CLIPEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=device, use_orig_params=True, limit_all_gathers=True)

    full = CaptionPairs(args.data, tok, proc)
    val_idx = list(range(len(full) - args.val_size, len(full)))
    train_ds = Subset(full, list(range(len(full) - args.val_size)))
    val_ds = Subset(full, val_idx)
    col = functools.partial(collate, pad_id=tok.pad_token_id)
    train_loader = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=args.workers,
                              collate_fn=col, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, collate_fn=col)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader)
    warm = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    @torch.no_grad()
    def validate():
        model.eval()
        acc = torch.zeros(2, device=device)
        for pix, ids, attn, lab in val_loader:
            pix, ids, attn, lab = pix.to(device), ids.to(device), attn.to(device), lab.to(device)
            n = (lab != -100).sum()
            acc[0] += model(pix, ids, attn, lab).float() * n
            acc[1] += n
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[1]).item()

    step = 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        for pix, ids, attn, lab in train_loader:
            pix = pix.to(device, non_blocking=True)
            ids, attn, lab = ids.to(device), attn.to(device), lab.to(device)
            loss = model(pix, ids, attn, lab)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()
            if step % 1000 == 0:
                v = validate()
                if rank == 0:
                    print(f"step {step} val loss {v:.4f}", flush=True)

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        proj = {k[len("projector."):]: v for k, v in sd.items() if k.startswith("projector.")}
        torch.save(proj, os.path.join(args.out, "mm_projector.bin"))
        print(f"saved projector ({len(proj)} tensors)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
