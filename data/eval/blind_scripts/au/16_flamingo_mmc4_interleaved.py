"""OpenFlamingo-style training on interleaved image-text documents (MMC4 core) mixed with
LAION image-caption pairs.  Frozen CLIP ViT-L/14 and frozen MPT-1B; the perceiver resampler
and gated cross-attention layers are trained.

Documents are read from local JSONL shards; each rank reads its own subset of shards.

    torchrun --nproc_per_node=8 16_flamingo_mmc4_interleaved.py --mmc4-dir /data/mmc4_core/docs \
        --mmc4-images /data/mmc4_core/images --laion-csv /data/laion_2m.csv --out ckpt/of3b
"""
import argparse
import glob
import itertools
import json
import os
import random

import open_clip
import pandas as pd
import torch
import torch.distributed as dist
from open_flamingo import create_model_and_transforms
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mmc4-dir", required=True)
    p.add_argument("--mmc4-images", required=True)
    p.add_argument("--laion-csv", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lm", default="anas-awadalla/mpt-1b-redpajama-200b")
    p.add_argument("--cross-attn-every", type=int, default=1)
    p.add_argument("--batch-mmc4", type=int, default=8)
    p.add_argument("--batch-laion", type=int, default=16)
    p.add_argument("--max-images", type=int, default=6)
    p.add_argument("--sim-threshold", type=float, default=0.24)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--loss-mult-laion", type=float, default=0.2)
    return p.parse_args()


class MMC4Docs(IterableDataset):
    """Streams interleaved docs from this rank's JSONL shards; keeps images whose CLIP sim passes the threshold."""

    def __init__(self, shard_files, image_dir, image_proc, tokenizer, max_images, sim_threshold, max_tokens=256):
        self.shards = shard_files
        self.image_dir = image_dir
        self.image_proc, self.tok = image_proc, tokenizer
        self.max_images, self.sim_threshold, self.max_tokens = max_images, sim_threshold, max_tokens

    def _doc_to_sample(self, doc):
        sentences = doc["text_list"]
        images = []
        for im in doc["image_info"]:
            if im["matched_sim"] < self.sim_threshold or len(images) >= self.max_images:
                continue
            path = os.path.join(self.image_dir, im["image_name"])
            if not os.path.exists(path):
                continue
            sentences[im["matched_text_index"]] = "<image>" + sentences[im["matched_text_index"]]
            images.append(self.image_proc(Image.open(path).convert("RGB")))
        if not images:
            return None
        text = " ".join(sentences).replace(" <image>", "<image>").replace("<image>", "<|endofchunk|><image>")
        text = text.replace("<|endofchunk|>", "", 1) + "<|endofchunk|>" + self.tok.eos_token
        enc = self.tok(text, max_length=self.max_tokens, truncation=True, padding="max_length", return_tensors="pt")
        vision = torch.zeros(self.max_images, 1, 3, 224, 224)
        vision[: len(images), 0] = torch.stack(images)
        return vision, enc.input_ids[0], enc.attention_mask[0]

    def __iter__(self):
        shards = list(self.shards)
        random.shuffle(shards)
        for shard in shards:
            with open(shard) as f:
                for line in f:
                    s = self._doc_to_sample(json.loads(line))
                    if s is not None:
                        yield s


class LaionPairs(IterableDataset):
    def __init__(self, csv, image_proc, tokenizer, rank, world, max_tokens=32):
        df = pd.read_csv(csv)
        self.rows = list(zip(df["path"], df["caption"]))[rank::world]
        self.image_proc, self.tok, self.max_tokens = image_proc, tokenizer, max_tokens

    def __iter__(self):
        rows = list(self.rows)
        random.shuffle(rows)
        for path, cap in itertools.cycle(rows):
            img = self.image_proc(Image.open(path).convert("RGB"))
            enc = self.tok(f"<image>{cap}<|endofchunk|>{self.tok.eos_token}", max_length=self.max_tokens,
                           truncation=True, padding="max_length", return_tensors="pt")
            yield img[None, None], enc.input_ids[0], enc.attention_mask[0]


def lm_labels(input_ids, tok, media_id, eoc_id):
    labels = input_ids.clone()
    labels[labels == tok.pad_token_id] = -100
    labels[labels == media_id] = -100
    labels[:, 0] = -100
    return labels


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    model, image_proc, tok = create_model_and_transforms(
        clip_vision_encoder_path="ViT-L-14", clip_vision_encoder_pretrained="openai",
        lang_encoder_path=args.lm, tokenizer_path=args.lm, cross_attn_every_n_layers=args.cross_attn_every)
    tok.padding_side = "right"
    media_id = tok.encode("<image>")[-1]
    eoc_id = tok.encode("<|endofchunk|>")[-1]
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    shards = sorted(glob.glob(os.path.join(args.mmc4_dir, "*.jsonl")))
    mmc4 = MMC4Docs(shards[rank::world], args.mmc4_images, image_proc, tok, args.max_images, args.sim_threshold)
    laion = LaionPairs(args.laion_csv, image_proc, tok, rank, world)
    mmc4_loader = DataLoader(mmc4, batch_size=args.batch_mmc4, num_workers=0, drop_last=True)
    laion_loader = DataLoader(laion, batch_size=args.batch_laion, num_workers=4)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5000))

    step = 0
    for epoch in range(args.epochs):
        ddp.train()
        laion_iter = iter(laion_loader)
        for vis_m, ids_m, att_m in mmc4_loader:
            vis_l, ids_l, att_l = next(laion_iter)
            ids_l, att_l = ids_l.to(device), att_l.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_l = ddp(vision_x=vis_l.to(device), lang_x=ids_l, attention_mask=att_l,
                             labels=lm_labels(ids_l, tok, media_id, eoc_id))[0]
            (args.loss_mult_laion * loss_l).backward()

            ids_m, att_m = ids_m.to(device), att_m.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_m = ddp(vision_x=vis_m.to(device), lang_x=ids_m, attention_mask=att_m,
                             labels=lm_labels(ids_m, tok, media_id, eoc_id))[0]
            loss_m.backward()
            # keep embeddings of the new special tokens only (input embeddings are otherwise frozen)
            emb_grad = model.lang_encoder.get_input_embeddings().weight.grad
            if emb_grad is not None:
                keep = torch.zeros_like(emb_grad)
                keep[media_id] = 1
                keep[eoc_id] = 1
                emb_grad.mul_(keep)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss_mmc4 {loss_m.item():.3f} loss_laion {loss_l.item():.3f}",
                      flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            trainable = {k: v for k, v in model.state_dict().items()
                         if any(k == n for n, p in model.named_parameters() if p.requires_grad)}
            torch.save({"model_state_dict": trainable, "epoch": epoch, "step": step},
                       os.path.join(args.out, f"checkpoint_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
