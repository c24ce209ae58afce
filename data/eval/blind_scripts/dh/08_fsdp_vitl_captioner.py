"""ViT-L/14 (CLIP) + 12-layer transformer decoder captioner trained with FSDP.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    08_fsdp_vitl_captioner.py --out /shared/exp/cap_fsdp
"""
import argparse
import functools
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from timm.models.vision_transformer import Block as ViTBlock
from transformers import AutoTokenizer
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


class DecoderBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mem, causal):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        h = self.ln2(x)
        x = x + self.cross_attn(h, mem, mem, need_weights=False)[0]
        return x + self.mlp(self.ln3(x))


class Captioner(nn.Module):
    def __init__(self, encoder_name, vocab_size, d=768, layers=12, heads=12, max_len=40):
        super().__init__()
        self.encoder = timm.create_model(encoder_name, pretrained=True, num_classes=0)
        self.proj = nn.Linear(self.encoder.num_features, d)
        self.tok_emb = nn.Embedding(vocab_size, d)
        self.pos_emb = nn.Parameter(torch.zeros(1, max_len, d))
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, images, ids):
        mem = self.proj(self.encoder.forward_features(images))
        T = ids.size(1)
        x = self.tok_emb(ids) + self.pos_emb[:, :T]
        causal = torch.triu(torch.full((T, T), float("-inf"), device=ids.device), 1)
        for blk in self.blocks:
            x = blk(x, mem, causal)
        return self.lm_head(self.ln_f(x))


class CocoKarpathy(Dataset):
    def __init__(self, ann, root, split, tf):
        imgs = [im for im in json.load(open(ann))["images"]
                if im["split"] in (("train", "restval") if split == "train" else (split,))]
        self.train = split == "train"
        self.items = ([(im, s["raw"]) for im in imgs for s in im["sentences"]] if self.train
                      else [(im, "") for im in imgs])
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in imgs}
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        im, cap = self.items[i]
        img = Image.open(os.path.join(self.root, im["filepath"], im["filename"])).convert("RGB")
        return self.tf(img), cap, im["cocoid"]


@torch.no_grad()
def generate_fixed_steps(model, images, bos, eos, steps):
    # every rank runs the same number of sharded forwards, so no early exit here
    ids = torch.full((images.size(0), 1), bos, dtype=torch.long, device=images.device)
    for _ in range(steps):
        nxt = model(images, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    out = []
    for seq in ids[:, 1:].tolist():
        out.append(seq[:seq.index(eos)] if eos in seq else seq)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", default="/shared/coco/dataset_coco.json")
    ap.add_argument("--images", default="/shared/coco/images")
    ap.add_argument("--out", default="/shared/exp/cap_fsdp")
    ap.add_argument("--init_from", default=None, help="full (unsharded) model state dict")
    ap.add_argument("--encoder", default="vit_large_patch14_clip_224.openai")
    ap.add_argument("--global_batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max_len", type=int, default=40)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained("bert-base-uncased")
    model = Captioner(args.encoder, tok.vocab_size, max_len=args.max_len)
    if args.init_from and rank == 0:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ViTBlock, DecoderBlock})
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), sync_module_states=True, use_orig_params=True,
                 limit_all_gathers=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, (ViTBlock, DecoderBlock)))

    norm = transforms.Normalize((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))
    train_set = CocoKarpathy(args.ann, args.images, "train", transforms.Compose(
        [transforms.RandomResizedCrop(224, scale=(0.7, 1.0)), transforms.ToTensor(), norm]))
    val_set = CocoKarpathy(args.ann, args.images, "val", transforms.Compose(
        [transforms.Resize(224), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=10, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=50, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=6, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.98))
    total = len(loader) * args.epochs
    warm = total // 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, caps, _ in loader:
            images = images.cuda(non_blocking=True)
            enc = tok(list(caps), padding="longest", truncation=True, max_length=args.max_len,
                      return_tensors="pt").to(images.device)
            logits = model(images, enc.input_ids[:, :-1])
            labels = enc.input_ids[:, 1:].masked_fill(enc.attention_mask[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f}", flush=True)

        model.eval()
        local = []
        for images, _, image_ids in val_loader:
            seqs = generate_fixed_steps(model, images.cuda(non_blocking=True),
                                        tok.cls_token_id, tok.sep_token_id, args.max_len - 1)
            local += [(i, tok.decode(s, skip_special_tokens=True)) for i, s in zip(image_ids.tolist(), seqs)]
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = {i: c for part in parts for i, c in part}
            ptb = PTBTokenizer()
            gts = ptb.tokenize({i: [{"caption": c} for c in val_set.refs[i]] for i in preds})
            res = ptb.tokenize({i: [{"caption": c}] for i, c in preds.items()})
            cider, _ = Cider().compute_score(gts, res)
            print(f"epoch {epoch} val CIDEr {cider * 100:.2f} on {len(preds)} images", flush=True)

        # gather a full copy on rank 0 (all ranks take part), offloaded to CPU
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        if rank == 0:
            torch.save({"model": model_state, "optimizer": optim_state, "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch_{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
