"""ShareGPT4V-style pretraining stage: the projector and the second half of the CLIP
ViT-L/14-336 are trained on detailed captions, the LLM stays frozen.

Features come from the penultimate ViT layer (select_layer=-2).  The unfrozen ViT blocks
are run with activation checkpointing to fit 336px inputs at batch 16/GPU.

    torchrun --nproc_per_node=8 12_sharegpt4v_vit_unfreeze.py --data /data/sharegpt4v/share-captioner_coco_lcs_sam_1246k.json \
        --image-folder /data/sharegpt4v/images --projector ckpt/stage1/mm_projector.bin --out ckpt/sharegpt4v_pt
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    p.add_argument("--vision-tower", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--data", required=True)
    p.add_argument("--image-folder", required=True)
    p.add_argument("--projector", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--unfreeze-from", type=int, default=12, help="first trainable ViT block")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--vit-lr", type=float, default=2e-6)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--save-every", type=int, default=2000)
    return p.parse_args()


class CaptionData(Dataset):
    def __init__(self, path, folder, tok, proc, max_len):
        self.items = [x for x in json.load(open(path)) if "image" in x]
        self.folder, self.tok, self.proc, self.max_len = folder, tok, proc, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        pix = self.proc(Image.open(os.path.join(self.folder, ex["image"])).convert("RGB"),
                        return_tensors="pt").pixel_values[0]
        cap = ex["conversations"][1]["value"]
        ids = self.tok(cap + self.tok.eos_token, add_special_tokens=False, truncation=True,
                       max_length=self.max_len - 1).input_ids
        return pix, torch.tensor([self.tok.bos_token_id] + ids)


def collate(batch, pad_id):
    pix = torch.stack([b[0] for b in batch])
    ids = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=pad_id)
    return pix, ids


class VisionTower(nn.Module):
    def __init__(self, name, unfreeze_from, select_layer=-2, grad_ckpt=True):
        super().__init__()
        self.clip = CLIPVisionModel.from_pretrained(name)
        self.select_layer = select_layer
        self.unfreeze_from = unfreeze_from
        self.grad_ckpt = grad_ckpt
        self.clip.requires_grad_(False)
        for layer in self.clip.vision_model.encoder.layers[unfreeze_from:]:
            layer.requires_grad_(True)
        self.clip.vision_model.post_layernorm.requires_grad_(True)

    def forward(self, pixel_values):
        vm = self.clip.vision_model
        h = vm.pre_layrnorm(vm.embeddings(pixel_values))
        layers = vm.encoder.layers
        n_run = len(layers) + 1 + self.select_layer  # hidden_states[-2] == output of layer n-2
        for i in range(n_run):
            if i == self.unfreeze_from and self.training and not h.requires_grad:
                h = h.detach().requires_grad_(True)  # frozen prefix carries no grad; checkpoint() needs one
            if self.grad_ckpt and self.training and i >= self.unfreeze_from:
                h = cp.checkpoint(layers[i], h, None, None)[0]
            else:
                h = layers[i](h, None, None)[0]
        return h[:, 1:]


class ShareGPT4VPretrain(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.vision = VisionTower(args.vision_tower, args.unfreeze_from)
        self.llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
        self.llm.requires_grad_(False)
        d_v, d_l = self.vision.clip.config.hidden_size, self.llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(d_v, d_l), nn.GELU(), nn.Linear(d_l, d_l))

    def forward(self, pix, ids, pad_id):
        img = self.mm_projector(self.vision(pix))
        tok = self.llm.get_input_embeddings()(ids)
        # <s> [image tokens] caption </s>
        inputs = torch.cat([tok[:, :1], img.to(tok.dtype), tok[:, 1:]], 1)
        att = torch.cat([torch.ones(ids.size(0), 1 + img.size(1), dtype=torch.long, device=ids.device),
                         ids[:, 1:].ne(pad_id).long()], 1)
        labels = torch.cat([torch.full((ids.size(0), 1 + img.size(1)), -100, device=ids.device),
                            ids[:, 1:].masked_fill(ids[:, 1:] == pad_id, -100)], 1)
        return self.llm(inputs_embeds=inputs, attention_mask=att, labels=labels).loss


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision_tower)

    model = ShareGPT4VPretrain(args)
    if args.projector:
        sd = torch.load(args.projector, map_location="cpu")
        model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v for k, v in sd.items()})
    model.to(device)
    # last ViT block and post_layernorm are trainable but skipped by select_layer=-2
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    ds = CaptionData(args.data, args.image_folder, tok, proc, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, collate_fn=lambda b: collate(b, tok.pad_token_id))

    vit_params = [p for p in model.vision.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": model.mm_projector.parameters(), "lr": args.lr},
                             {"params": vit_params, "lr": args.vit_lr}], weight_decay=0.0)
    total = args.epochs * len(loader)
    warm = int(0.03 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for pix, ids in loader:
            pix, ids = pix.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(pix, ids, tok.pad_token_id)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item() / world:.4f}", flush=True)
            if step % args.save_every == 0 and rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"mm_projector": model.mm_projector.state_dict(),
                            "vision": {k: v for k, v in model.vision.clip.state_dict().items()},
                            "step": step}, os.path.join(args.out, f"step{step}.pt"))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.mm_projector.state_dict(), os.path.join(args.out, "mm_projector.bin"))
        model.vision.clip.save_pretrained(os.path.join(args.out, "vision_tower"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
