"""LLaVA-1.5 visual instruction tuning (stage 2) with DeepSpeed ZeRO-3 through the Python API.

Vision tower frozen, projector + LLM trained in bf16.  Optionally starts the projector
from a separately trained stage-1 checkpoint.

    deepspeed --num_gpus 8 06_llava_zero3_finetune.py --data /data/llava_v1_5_mix665k.json \
        --image-folder /data/llava_images --val-data /data/llava_val_2k.json \
        --pretrain-projector ckpt/stage1/mm_projector.bin --out ckpt/llava15_7b_ft
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LlavaForConditionalGeneration
from transformers.integrations import HfDeepSpeedConfig


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llava-hf/llava-1.5-7b-hf")
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--image-folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--pretrain-projector", default=None)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--save-steps", type=int, default=1000)
    p.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return p.parse_args()


class InstructDataset(Dataset):
    def __init__(self, path, image_folder, processor, max_len):
        self.items = [x for x in json.load(open(path)) if "image" in x]
        self.image_folder = image_folder
        self.processor = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        image = Image.open(os.path.join(self.image_folder, ex["image"])).convert("RGB")
        turns = ex["conversations"]
        prompt, full = "", ""
        for j in range(0, len(turns) - 1, 2):
            q = turns[j]["value"].replace("<image>", "").strip()
            if j == 0:
                q = "<image>\n" + q
            full += f"USER: {q} ASSISTANT:"
            if j == len(turns) - 2:
                prompt = full
            full += f" {turns[j + 1]['value']}</s>"
        enc = self.processor(text=full, images=image, return_tensors="pt")
        n_prompt = len(self.processor(text=prompt, images=image, return_tensors="pt").input_ids[0])
        ids = enc.input_ids[0][: self.max_len]  # image tokens sit at the front, so tail truncation keeps them
        labels = ids.clone()
        labels[:n_prompt] = -100  # supervise the last answer only
        return ids, enc.attention_mask[0][: self.max_len], enc.pixel_values[0], labels


def make_collate(pad_id):
    def collate(batch):
        ids = torch.nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
        att = torch.nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=0)
        lab = torch.nn.utils.rnn.pad_sequence([b[3] for b in batch], batch_first=True, padding_value=-100)
        return {"input_ids": ids, "attention_mask": att, "pixel_values": torch.stack([b[2] for b in batch]),
                "labels": lab}
    return collate


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    grad_accum = args.global_batch // (args.micro_batch * world)
    assert grad_accum * args.micro_batch * world == args.global_batch, "global batch not divisible"
    ds_config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1e9,
        "wall_clock_breakdown": False,
    }
    # must exist (and stay referenced) before from_pretrained so weights are partitioned at load time
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841

    processor = AutoProcessor.from_pretrained(args.model)
    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.vision_tower.requires_grad_(False)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if args.pretrain_projector:
        proj_sd = torch.load(args.pretrain_projector, map_location="cpu")
        params = list(model.multi_modal_projector.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                model.multi_modal_projector.load_state_dict(proj_sd)

    train_ds = InstructDataset(args.data, args.image_folder, processor, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    collate = make_collate(processor.tokenizer.pad_token_id)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    steps_per_epoch = len(loader) // grad_accum
    total = steps_per_epoch * args.epochs
    warmup = int(0.03 * total)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / max(1, warmup) if s < warmup
        else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    device = engine.device

    val_loader = None
    if args.val_data:
        val_ds = InstructDataset(args.val_data, args.image_folder, processor, args.max_len)
        # padded sampler: every rank runs the same number of forwards (ZeRO-3 gathers params inside each one)
        val_loader = DataLoader(val_ds, batch_size=args.micro_batch, collate_fn=collate, num_workers=2,
                                sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False))

    def evaluate():
        engine.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                out = engine(**batch)
                n = (batch["labels"][:, 1:] != -100).sum()
                tot += torch.stack([out.loss.float() * n, n.float()])
        dist.all_reduce(tot)
        engine.train()
        return (tot[0] / tot[1]).item()

    def export_hf(tag):
        # every rank takes part in the gather; only rank 0 writes
        state = engine._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            path = os.path.join(args.out, tag)
            engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
            processor.save_pretrained(path)

    engine.train()
    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary():
                global_step += 1
                if global_step % 10 == 0:
                    l = loss.detach().float()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} step {global_step}/{total} loss {l.item():.4f} "
                              f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
                if global_step % args.save_steps == 0:
                    engine.save_checkpoint(args.out, tag=f"step{global_step}")
                    if val_loader is not None:
                        vl = evaluate()
                        if rank == 0:
                            print(f"step {global_step} val_loss {vl:.4f}", flush=True)

    engine.save_checkpoint(args.out, tag="final")
    export_hf("hf_final")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
