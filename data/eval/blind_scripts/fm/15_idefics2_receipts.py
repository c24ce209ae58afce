"""Idefics2-8B fine-tuning for receipt key-information extraction (JSON output), FSDP.

One annotation file; a held-out slice of it is used for validation.

    torchrun --nproc_per_node=8 15_idefics2_receipts.py --ann /data/receipts/annotations.jsonl
"""
import argparse
import functools
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, Idefics2ForConditionalGeneration, get_constant_schedule_with_warmup
from transformers.models.idefics2.modeling_idefics2 import Idefics2EncoderLayer, Idefics2PerceiverLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

INSTRUCTION = "Extract the store name, date, items and total from this receipt as JSON."


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class Receipts(Dataset):
    def __init__(self, records, image_root, augment=False):
        self.records = records
        self.image_root = image_root
        self.augment = augment

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = Image.open(os.path.join(self.image_root, r["image"])).convert("RGB")
        if self.augment and random.random() < 0.3:
            angle = random.uniform(-3, 3)
            img = img.rotate(angle, expand=True, fillcolor=(255, 255, 255))
        return img, json.dumps(r["fields"], ensure_ascii=False)


class Collate:
    def __init__(self, processor):
        self.processor = processor
        self.end_of_utt = processor.tokenizer.convert_tokens_to_ids("<end_of_utterance>")

    def __call__(self, batch):
        texts, images = [], []
        for img, target in batch:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": target}]}]
            texts.append(self.processor.apply_chat_template(msgs, add_generation_prompt=False).strip())
            images.append([img])
        enc = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        image_tok = self.processor.tokenizer.convert_tokens_to_ids("<image>")
        labels[labels == image_tok] = -100
        # mask everything up to and including the user's end-of-utterance token
        for b in range(labels.shape[0]):
            eou = (enc["input_ids"][b] == self.end_of_utt).nonzero()
            if len(eou):
                labels[b, : eou[0, 0] + 1] = -100
        enc["labels"] = labels
        return enc


def split_records(path, val_fraction):
    with open(path) as f:
        records = [json.loads(l) for l in f]
    random.shuffle(records)
    n_val = max(1, int(len(records) * val_fraction))
    return records[n_val:], records[:n_val]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
        n = (batch["labels"][:, 1:] != -100).sum()
        tot[0] += model(**batch).loss.float() * n
        tot[1] += n
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceM4/idefics2-8b")
    ap.add_argument("--ann", required=True)
    ap.add_argument("--image-root", default="/data/receipts/images")
    ap.add_argument("--out", default="checkpoints/idefics2-receipts")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)  # different augmentation stream per rank

    processor = AutoProcessor.from_pretrained(args.model, do_image_splitting=False)
    model = Idefics2ForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model.model.vision_model.requires_grad_(False)
    model.config.use_cache = False

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={MistralDecoderLayer, Idefics2EncoderLayer,
                                                      Idefics2PerceiverLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=device, use_orig_params=True)

    train_recs, val_recs = split_records(args.ann, args.val_fraction)
    train_ds = Receipts(train_recs, args.image_root, augment=True)
    val_ds = Receipts(val_recs, args.image_root)
    collate = Collate(processor)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collate, num_workers=4,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False))
    if rank == 0:
        print(f"train {len(train_ds)}  val {len(val_ds)}  steps/epoch {len(train_loader)}", flush=True)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.01)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=50)

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f}", flush=True)

        val_loss = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f}", flush=True)

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = model.state_dict()
        if rank == 0 and val_loss < best:
            best = val_loss
            os.makedirs(args.out, exist_ok=True)
            torch.save(sd, os.path.join(args.out, "best.bin"))
            processor.save_pretrained(args.out)
            print(f"saved best (val_loss {best:.4f})", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
