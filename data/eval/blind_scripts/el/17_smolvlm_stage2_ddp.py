#!/usr/bin/env python
"""Stage-2 SFT for the small on-device VLM: SigLIP-B/16-512 + SmolLM2-1.7B-Instruct.

Conversations are truncated to max_len minus the 256 image tokens; some of the
OCR-heavy samples have very long user turns and lose their answers entirely.

    torchrun --nproc_per_node 8 17_smolvlm_stage2_ddp.py --train_json data/sft_mix.json \
        --image_root /data/sft_images --projector runs/smol-s1/projector.pt
"""
import argparse
import functools
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel,
                          get_cosine_schedule_with_warmup)

logger = logging.getLogger("smolvlm")
IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="HuggingFaceTB/SmolLM2-1.7B-Instruct")
    ap.add_argument("--vision", default="google/siglip-base-patch16-512")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--train_json", required=True)
    ap.add_argument("--image_root", required=True)
    ap.add_argument("--out", default="runs/smol-s2")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--save_every", type=int, default=1500)
    return ap.parse_args()


class SFTData(Dataset):
    def __init__(self, path, root, tok, proc, max_text_len):
        self.rows = json.load(open(path))
        self.root, self.tok, self.proc, self.max_text_len = root, tok, proc, max_text_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        msgs = [{"role": "user" if t["from"] == "human" else "assistant",
                 "content": t["value"].replace("<image>", "").strip()} for t in r["conversations"]]
        ids, labels = [], []
        for k in range(len(msgs)):
            prev = len(ids)
            ids = self.tok.apply_chat_template(msgs[: k + 1], tokenize=True, add_generation_prompt=False)
            piece = ids[prev:]
            labels += piece if msgs[k]["role"] == "assistant" else [IGNORE_INDEX] * len(piece)
        px = self.proc(Image.open(os.path.join(self.root, r["image"])).convert("RGB"),
                       return_tensors="pt").pixel_values[0]
        return (torch.tensor(ids[: self.max_text_len]), torch.tensor(labels[: self.max_text_len]), px)


def collate(batch, pad_id):
    ids, labels, px = zip(*batch)
    lens = torch.tensor([len(x) for x in ids])
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    mask = (torch.arange(ids.size(1))[None, :] < lens[:, None]).long()
    return ids, mask, labels, torch.stack(px)


class PixelShuffleProjector(nn.Module):
    """2x2 pixel-shuffle (1024 -> 256 tokens) followed by an MLP, as in Idefics3/SmolVLM."""

    def __init__(self, d_vis, d_llm, scale=2):
        super().__init__()
        self.scale = scale
        self.mlp = nn.Sequential(nn.Linear(d_vis * scale * scale, d_llm), nn.GELU(), nn.Linear(d_llm, d_llm))

    def forward(self, x):
        b, n, d = x.shape
        h = w = int(math.sqrt(n))
        x = x.view(b, h, w, d).permute(0, 3, 1, 2)
        x = F.pixel_unshuffle(x, self.scale)
        x = x.flatten(2).transpose(1, 2)
        return self.mlp(x)


class SmolVLM(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        self.projector = PixelShuffleProjector(vision.config.hidden_size, llm.config.hidden_size)

    def forward(self, ids, mask, labels, px):
        with torch.no_grad():
            f = self.vision(px).last_hidden_state
        img = self.projector(f.float()).to(torch.bfloat16)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([img, txt], 1)
        m = torch.cat([mask.new_ones(img.shape[:2]), mask], 1)
        y = torch.cat([labels.new_full(img.shape[:2], IGNORE_INDEX), labels], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s][rank {rank}] %(message)s")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tok = AutoTokenizer.from_pretrained(args.llm)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    proc = SiglipImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    vision = SiglipVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = SmolVLM(llm, vision)
    model.projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    model = DDP(model.to(device), device_ids=[local_rank])

    n_img_tokens = (512 // 16) ** 2 // 4
    ds = SFTData(args.train_json, args.image_root, tok, proc, args.max_len - n_img_tokens)
    sampler = DistributedSampler(ds, shuffle=True, seed=7)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, collate_fn=functools.partial(collate, pad_id=tok.pad_token_id))

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, int(0.02 * total), total)
    logger.info("samples %d, steps %d", len(ds), total)

    step, skipped = 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for ids, mask, labels, px in loader:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            loss = model(ids, mask, labels, px.to(device, torch.bfloat16))
            if not torch.isfinite(loss):
                # fully truncated batch or bf16 overflow
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                stats = torch.stack([loss.detach().float(), gn.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f grad_norm %.2f lr %.2e skipped %d", epoch, step,
                            stats[0].item(), stats[1].item(), sched.get_last_lr()[0], skipped)
            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step}.pt"))
                dist.barrier()

    if rank == 0:
        model.module.llm.save_pretrained(os.path.join(args.out, "llm"))
        tok.save_pretrained(os.path.join(args.out, "llm"))
        torch.save(model.module.projector.state_dict(), os.path.join(args.out, "projector.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
