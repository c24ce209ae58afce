"""Nougat fine-tuning: scanned annual reports / technical manuals -> markdown.

Pages are paired with markdown produced from the publisher source files (see
tools/align_md.py). Trained with FSDP because the 10-layer mBART decoder at 3584 tokens
plus the Swin encoder at 896x672 runs out of memory under DDP at batch 1.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        20_nougat_fsdp_reports_to_markdown.py --data /fsx/docai/nougat_pairs --out /fsx/docai/runs/nougat_ft
"""
import argparse
import functools
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import NougatProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup
from transformers.models.donut.modeling_donut_swin import DonutSwinLayer
from transformers.models.mbart.modeling_mbart import MBartDecoderLayer

logger = logging.getLogger("nougat_ft")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="facebook/nougat-base")
    ap.add_argument("--max_tokens", type=int, default=3584)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=250)
    ap.add_argument("--save_every_epochs", type=int, default=1)
    return ap.parse_args()


class PagePairs(Dataset):
    def __init__(self, root, split, processor, max_tokens):
        with open(os.path.join(root, f"{split}.jsonl")) as fh:
            self.pairs = [json.loads(l) for l in fh]
        self.root = root
        self.processor = processor
        self.max_tokens = max_tokens

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        p = self.pairs[i]
        image = Image.open(os.path.join(self.root, p["page"])).convert("RGB")
        pixel_values = self.processor(image, return_tensors="pt").pixel_values[0]
        with open(os.path.join(self.root, p["markdown"]), encoding="utf-8") as fh:
            md = fh.read()
        tok = self.processor.tokenizer
        ids = tok(md, max_length=self.max_tokens, truncation=True, padding="max_length",
                  return_tensors="pt").input_ids[0]
        ids[ids == tok.pad_token_id] = -100
        return {"pixel_values": pixel_values, "labels": ids}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = NougatProcessor.from_pretrained(args.base)
    model = VisionEncoderDecoderModel.from_pretrained(args.base)

    auto_wrap = functools.partial(transformer_auto_wrap_policy,
                                  transformer_layer_cls={DonutSwinLayer, MBartDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=auto_wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        use_orig_params=True,
    )

    train_ds = PagePairs(args.data, "train", processor, args.max_tokens)
    val_ds = PagePairs(args.data, "val", processor, args.max_tokens)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("train pages %d, val pages %d, world %d", len(train_ds), len(val_ds), world)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            out = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                        labels=batch["labels"].to(device, non_blocking=True))
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 20 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (%.1fs)", epoch, step, len(train_dl),
                            out.loss.item(), time.time() - t0)

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_dl:
                loss = model(pixel_values=batch["pixel_values"].to(device),
                             labels=batch["labels"].to(device)).loss
                val[0] += loss.float()
                val[1] += 1
        dist.all_reduce(val)
        if rank == 0:
            logger.info("epoch %d val loss %.4f (%.1f min)", epoch, (val[0] / val[1]).item(),
                        (time.time() - t0) / 60)

        if (epoch + 1) % args.save_every_epochs == 0:
            if rank == 0:
                policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
                    state = model.state_dict()
                ckpt_dir = os.path.join(args.out, f"epoch_{epoch}")
                model.module.save_pretrained(ckpt_dir, state_dict=state)
                processor.save_pretrained(ckpt_dir)
                logger.info("saved %s", ckpt_dir)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
