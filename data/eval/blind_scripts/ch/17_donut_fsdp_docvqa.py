"""Donut on DocVQA with PyTorch FSDP (full sharding, bf16), for 2560x1920 inputs.

    torchrun --nproc_per_node=8 17_donut_fsdp_docvqa.py --train-jsonl data/docvqa/train.jsonl \
        --val-jsonl data/docvqa/val.jsonl --image-dir data/docvqa/images
"""
import argparse
import functools
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup
from transformers.models.donut.modeling_donut_swin import DonutSwinLayer
from transformers.models.mbart.modeling_mbart import MBartDecoderLayer

TASK = "<s_docvqa>"
SPECIAL = [TASK, "<s_question>", "</s_question>", "<s_answer>", "</s_answer>"]


class DocVQA(Dataset):
    def __init__(self, jsonl, image_dir, processor, max_len, train):
        with open(jsonl) as f:
            self.items = [json.loads(l) for l in f]
        self.image_dir, self.processor, self.max_len, self.train = image_dir, processor, max_len, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        img = Image.open(os.path.join(self.image_dir, ex["image"])).convert("RGB")
        pixel_values = self.processor(img, random_padding=self.train, return_tensors="pt").pixel_values[0]
        answer = random.choice(ex["answers"]) if self.train else ex["answers"][0]
        prompt = f"{TASK}<s_question>{ex['question']}</s_question><s_answer>"
        full = prompt + answer + "</s_answer>" + self.processor.tokenizer.eos_token
        tok = self.processor.tokenizer
        ids = tok(full, add_special_tokens=False, max_length=self.max_len, truncation=True,
                  padding="max_length", return_tensors="pt").input_ids[0]
        n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
        labels = ids.clone()
        labels[:n_prompt] = -100
        labels[ids == tok.pad_token_id] = -100
        # decoder_input_ids start with the task token; labels are the next-token targets
        return {"pixel_values": pixel_values, "decoder_input_ids": ids[:-1], "labels": labels[1:]}


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def save_full_checkpoint(model, processor, out_dir, tag, rank):
    path = os.path.join(out_dir, tag)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        model.module.config.save_pretrained(path)
        processor.save_pretrained(path)
    dist.barrier()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)  # loss sum, correct tokens, total tokens
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        out = model(pixel_values=batch["pixel_values"], decoder_input_ids=batch["decoder_input_ids"])
        logits = out.logits.float()
        mask = batch["labels"] != -100
        loss = torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum")
        acc[0] += loss
        acc[1] += (logits.argmax(-1)[mask] == batch["labels"][mask]).sum()
        acc[2] += mask.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="naver-clova-ix/donut-base")
    ap.add_argument("--train-jsonl", required=True)
    ap.add_argument("--val-jsonl", required=True)
    ap.add_argument("--image-dir", required=True)
    ap.add_argument("--out-dir", default="runs/donut_docvqa_fsdp")
    ap.add_argument("--height", type=int, default=2560)
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    rank, world, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    processor = DonutProcessor.from_pretrained(args.model)
    processor.image_processor.size = {"height": args.height, "width": args.width}
    processor.tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    model = VisionEncoderDecoderModel.from_pretrained(args.model)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.encoder.image_size = [args.height, args.width]
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK)

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={DonutSwinLayer, MBartDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 use_orig_params=True, limit_all_gathers=True)

    train_ds = DocVQA(args.train_jsonl, args.image_dir, processor, args.max_len, train=True)
    val_ds = DocVQA(args.val_jsonl, args.image_dir, processor, args.max_len, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=train_sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    # FSDP runs collectives in every forward, so val shards must have equal length on all ranks
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch, sampler=val_sampler, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)

    best_loss = math.inf
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(pixel_values=batch["pixel_values"], decoder_input_ids=batch["decoder_input_ids"])
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                     batch["labels"].reshape(-1), ignore_index=-100)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss, tok_acc = validate(model, val_dl, device)
                if rank == 0:
                    print(f"[val] step {step} loss {val_loss:.4f} token-acc {tok_acc:.4f}", flush=True)
                if val_loss < best_loss:
                    best_loss = val_loss
                    save_full_checkpoint(model, processor, args.out_dir, "best", rank)

    save_full_checkpoint(model, processor, args.out_dir, "final", rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
