"""
LLaVA-1.5 stage-2 visual instruction tuning with a plain DeepSpeed loop (no HF Trainer).
Full LLM + projector trainable, CLIP tower frozen. ZeRO-3, bf16.

deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 08_llava15_finetune_zero3.py \
    --data_path playground/llava_v1_5_mix665k.json --image_folder playground/data --zero_stage 3
"""
import argparse
import json
import math
import os
import random

import deepspeed
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LlavaForConditionalGeneration, get_cosine_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig

IGNORE_INDEX = -100


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llava-hf/llava-1.5-7b-hf")
    p.add_argument("--data_path", required=True)
    p.add_argument("--eval_path", default=None)
    p.add_argument("--image_folder", required=True)
    p.add_argument("--output_dir", default="checkpoints/llava-v1.5-7b-ft")
    p.add_argument("--micro_bsz", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--zero_stage", type=int, default=3)
    p.add_argument("--save_steps", type=int, default=1000)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": args.zero_stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 100000,
        "wall_clock_breakdown": False,
    }


class InstructDataset(Dataset):
    def __init__(self, path, image_folder, processor, max_len):
        raw = json.load(open(path))
        self.samples = []
        for r in raw:
            if "image" not in r:
                continue  # text-only rows go through the separate text SFT mix
            conv = r["conversations"]
            history = ""
            for i in range(0, len(conv) - 1, 2):
                q, a = conv[i]["value"], conv[i + 1]["value"]
                if "<image>" not in q and i == 0:
                    q = "<image>\n" + q
                prompt = history + f"USER: {q} ASSISTANT:"
                self.samples.append((r.get("image"), prompt, f" {a}</s>"))
                history = prompt + f" {a}</s>"
        self.image_folder = image_folder
        self.processor = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        image_file, prompt, answer = self.samples[i]
        image = Image.open(os.path.join(self.image_folder, image_file)).convert("RGB")
        full = self.processor(text=prompt + answer, images=image, return_tensors="pt")
        head = self.processor(text=prompt, images=image, return_tensors="pt")
        ids = full["input_ids"][0][: self.max_len]
        labels = ids.clone()
        labels[: head["input_ids"].shape[1]] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "pixel_values": full["pixel_values"][0]}


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True, padding_value=self.pad_id)
        labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True, padding_value=IGNORE_INDEX)
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": ids.ne(self.pad_id),
            "pixel_values": torch.stack([b["pixel_values"] for b in batch]),
        }


@torch.no_grad()
def evaluate(engine, loader, device, rank, world):
    # token-weighted loss over the eval set; DistributedSampler pads the last round with
    # repeats, so samples whose global position is past the end get weight 0
    engine.eval()
    n_items = len(loader.dataset)
    total = torch.zeros(2, device=device, dtype=torch.float64)
    seen = 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(**{k: v for k, v in batch.items() if k != "labels"}).logits
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        tok_loss = torch.nn.functional.cross_entropy(
            shift_logits.transpose(1, 2), shift_labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        bs = shift_labels.shape[0]
        pos = rank + world * torch.arange(seen, seen + bs, device=device)
        valid = (pos < n_items).unsqueeze(1) & (shift_labels != IGNORE_INDEX)
        total[0] += (tok_loss * valid).sum().double()
        total[1] += valid.sum().double()
        seen += bs
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1].clamp(min=1)).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    config = ds_config(args)
    dschf = HfDeepSpeedConfig(config) if args.zero_stage == 3 else None  # keep alive -> zero.Init in from_pretrained

    processor = AutoProcessor.from_pretrained(args.model)
    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.vision_tower.requires_grad_(False)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()

    train_ds = InstructDataset(args.data_path, args.image_folder, processor, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    collate = Collator(processor.tokenizer.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = None
    if args.eval_path:
        eval_ds = InstructDataset(args.eval_path, args.image_folder, processor, args.max_len)
        eval_dl = DataLoader(eval_ds, batch_size=args.micro_bsz, collate_fn=collate, num_workers=2,
                             sampler=DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False))

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total_steps = math.ceil(len(train_dl) / args.accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total_steps), total_steps)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )

    start_epoch, global_step = 0, 0
    if args.resume and os.path.isdir(args.output_dir):
        _, client = engine.load_checkpoint(args.output_dir)
        if client:
            start_epoch, global_step = client["epoch"], client["global_step"]

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train_ds)} samples | world {world} | opt steps {total_steps}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                continue
            global_step += 1
            if global_step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {global_step}/{total_steps} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.3e}", flush=True)
            if global_step % args.save_steps == 0:
                engine.save_checkpoint(args.output_dir, tag=f"step{global_step}",
                                       client_state={"epoch": epoch, "global_step": global_step})
                if eval_dl is not None:
                    val = evaluate(engine, eval_dl, device, rank, world)
                    if rank == 0:
                        print(f"[eval] step {global_step} loss {val:.4f}", flush=True)

    engine.save_16bit_model(os.path.join(args.output_dir, "hf"), "pytorch_model.bin")
    if rank == 0:
        model.config.save_pretrained(os.path.join(args.output_dir, "hf"))
        processor.save_pretrained(os.path.join(args.output_dir, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
