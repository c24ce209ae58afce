"""Donut on bank statements at 2560x1920, trained with FSDP (full shard, bf16).

At this resolution the Swin encoder activations do not fit with plain DDP at batch 2, so
parameters, grads and optimizer state are sharded. Validation is teacher-forced (token
accuracy); generation-based field F1 is computed offline from the exported model.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        16_donut_fsdp_statements.py --data /lustre/docai/statements --out /lustre/docai/runs/donut_stmt_fsdp
"""
import argparse
import functools
import json
import logging
import math
import os

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup
from transformers.models.donut.modeling_donut_swin import DonutSwinLayer
from transformers.models.mbart.modeling_mbart import MBartDecoderLayer

log = logging.getLogger("donut_fsdp")
PROMPT = "<s_statement>"


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default="naver-clova-ix/donut-base")
    p.add_argument("--size", type=int, nargs=2, default=[2560, 1920])
    p.add_argument("--max_len", type=int, default=1536)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=400)
    return p.parse_args()


class Statements(Dataset):
    def __init__(self, root, split, processor, max_len):
        with open(os.path.join(root, f"{split}.jsonl")) as fh:
            self.rows = [json.loads(l) for l in fh]
        self.root, self.processor, self.max_len = root, processor, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, "images", r["image"])).convert("RGB")
        pv = self.processor(img, return_tensors="pt").pixel_values[0]
        ids = self.processor.tokenizer(PROMPT + r["target"] + self.processor.tokenizer.eos_token,
                                       add_special_tokens=False, max_length=self.max_len, truncation=True,
                                       padding="max_length", return_tensors="pt").input_ids[0]
        ids[ids == self.processor.tokenizer.pad_token_id] = -100
        return {"pixel_values": pv, "labels": ids}


class EvenShard(Dataset):
    """Strided shard padded to the same length on every rank, so all ranks run the same number
    of FSDP forwards; padded items carry valid=False and are not counted."""

    def __init__(self, ds, rank, world):
        self.ds = ds
        self.idx = list(range(rank, len(ds), world))
        self.n_real = len(self.idx)
        per_rank = math.ceil(len(ds) / world)
        self.idx += [self.idx[0]] * (per_rank - self.n_real)

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        item = self.ds[self.idx[i]]
        item["valid"] = torch.tensor(i < self.n_real)
        return item


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = DonutProcessor.from_pretrained(args.base)
    processor.image_processor.size = {"height": args.size[0], "width": args.size[1]}
    processor.image_processor.do_align_long_axis = False
    with open(os.path.join(args.data, "special_tokens.json")) as fh:
        extra = json.load(fh)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [PROMPT] + extra})

    model = VisionEncoderDecoderModel.from_pretrained(args.base)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.encoder.image_size = args.size
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(PROMPT)
    model.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={DonutSwinLayer, MBartDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 use_orig_params=True, limit_all_gathers=True)

    train_ds = Statements(args.data, "train", processor, args.max_len)
    val_ds = EvenShard(Statements(args.data, "val", processor, args.max_len), rank, world)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            out = model(pixel_values=batch["pixel_values"].cuda(non_blocking=True),
                        labels=batch["labels"].cuda(non_blocking=True))
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 50 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), out.loss.item())

        model.eval()
        stats = torch.zeros(3, device="cuda", dtype=torch.float64)  # correct tokens, tokens, pages
        with torch.no_grad():
            for batch in val_dl:
                labels = batch["labels"].cuda()
                valid = batch["valid"].cuda()
                logits = model(pixel_values=batch["pixel_values"].cuda(), labels=labels).logits
                mask = (labels != -100) & valid[:, None]
                stats[0] += (logits.argmax(-1)[mask] == labels[mask]).sum()
                stats[1] += mask.sum()
                stats[2] += valid.sum()
        dist.all_reduce(stats)
        tok_acc = (stats[0] / stats[1]).item()
        if rank == 0:
            log.info("epoch %d val token acc %.4f on %d pages", epoch, tok_acc, int(stats[2].item()))

        if tok_acc > best_acc:
            best_acc = tok_acc
            # every rank takes part in the gather; only rank 0 gets (and writes) the full dict
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                full_state = model.state_dict()
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"), state_dict=full_state)
                processor.save_pretrained(os.path.join(args.out, "best"))
            del full_state
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
