"""Document-VQA SFT of Qwen2-VL-7B with FSDP; preemptible cluster, so resume matters.

Checkpoint layout (one directory per save):
    model.pt      consolidated weights (rank 0)
    optim.pt      optimizer state
    trainer.json  step / epoch / sampler position

    torchrun --nproc_per_node=8 11_qwen2vl_doc_sft.py --train docvqa_train.jsonl --resume auto
"""
import argparse
import functools
import glob
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from qwen_vl_utils import process_vision_info
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration, get_cosine_schedule_with_warmup
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer, Qwen2VLVisionBlock


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2-VL-7B-Instruct")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", default=None)
    ap.add_argument("--image-dir", default="/data/docvqa/images")
    ap.add_argument("--ckpt-root", default="/checkpoints/qwen2vl-docvqa")
    ap.add_argument("--resume", default=None, help="checkpoint dir or 'auto'")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=400)
    ap.add_argument("--max-pixels", type=int, default=1280 * 28 * 28)
    return ap.parse_args()


class DocVQA(Dataset):
    def __init__(self, path, image_dir):
        with open(path) as f:
            self.rows = [json.loads(x) for x in f]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"image": os.path.join(self.image_dir, r["image"]), "q": r["question"], "a": r["answers"][0]}


class Collator:
    def __init__(self, processor, max_pixels):
        self.processor = processor
        self.max_pixels = max_pixels
        self.assistant_header = processor.tokenizer("<|im_start|>assistant\n").input_ids

    def __call__(self, batch):
        msgs, texts = [], []
        for ex in batch:
            m = [{"role": "user", "content": [{"type": "image", "image": ex["image"], "max_pixels": self.max_pixels},
                                              {"type": "text", "text": ex["q"]}]},
                 {"role": "assistant", "content": [{"type": "text", "text": ex["a"]}]}]
            msgs.append(m)
            texts.append(self.processor.apply_chat_template(m, tokenize=False))
        images, _ = process_vision_info(msgs)
        enc = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        h = len(self.assistant_header)
        for b in range(labels.shape[0]):
            ids = enc["input_ids"][b].tolist()
            start = max(i for i in range(len(ids) - h) if ids[i:i + h] == self.assistant_header) + h
            labels[b, :start] = -100
        enc["labels"] = labels
        return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        n = (batch["labels"][:, 1:] != -100).sum()
        acc[0] += model(**batch).loss.float() * n
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def latest_checkpoint(root):
    dirs = sorted(glob.glob(os.path.join(root, "step_*")))
    return dirs[-1] if dirs else None


def save_checkpoint(model, optimizer, scheduler, step, epoch, args, rank):
    ckpt_dir = os.path.join(args.ckpt_root, f"step_{step:07d}")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        model_state = model.state_dict()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        torch.save(model_state, os.path.join(ckpt_dir, "model.pt"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(ckpt_dir, "optim.pt"))
        with open(os.path.join(ckpt_dir, "trainer.json"), "w") as f:
            json.dump({"step": step, "epoch": epoch}, f)
        print(f"[ckpt] saved {ckpt_dir}", flush=True)
    dist.barrier()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    resume_dir = latest_checkpoint(args.ckpt_root) if args.resume == "auto" else args.resume

    processor = AutoProcessor.from_pretrained(args.model)
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32,
                                                            attn_implementation="flash_attention_2")
    if resume_dir:
        model.load_state_dict(torch.load(os.path.join(resume_dir, "model.pt"), map_location="cpu"))
    model.visual.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={Qwen2VLDecoderLayer, Qwen2VLVisionBlock})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=device, use_orig_params=True, limit_all_gathers=True)

    ds = DocVQA(args.train, args.image_dir)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        collate_fn=Collator(processor, args.max_pixels), drop_last=True, pin_memory=True)

    val_loader = None
    if args.val:
        val_ds = DocVQA(args.val, args.image_dir)
        val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4,
                                sampler=DistributedSampler(val_ds, shuffle=False),
                                collate_fn=Collator(processor, args.max_pixels))

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, total_steps)

    step, start_epoch = 0, 0
    if resume_dir:
        state = torch.load(os.path.join(resume_dir, "optim.pt"), map_location="cpu")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        with open(os.path.join(resume_dir, "trainer.json")) as f:
            meta = json.load(f)
        step, start_epoch = meta["step"], meta["epoch"]
        if rank == 0:
            print(f"resumed from {resume_dir} (step {step}, epoch {start_epoch})", flush=True)

    model.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = step - epoch * len(loader)  # batches of this epoch already consumed before preemption
        t0 = time.time()
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                loss = out.loss.detach()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total_steps} loss {loss.item():.4f} gnorm {gnorm.item():.2f} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                save_checkpoint(model, optimizer, scheduler, step, epoch, args, rank)
        if val_loader is not None:
            val_loss = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch} val_loss {val_loss:.4f}", flush=True)

    save_checkpoint(model, optimizer, scheduler, step, args.epochs, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
