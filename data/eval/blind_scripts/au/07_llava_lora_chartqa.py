"""LoRA fine-tuning of LLaVA-1.6 (Mistral-7B) on ChartQA with a frozen vision tower.

    torchrun --nproc_per_node=4 07_llava_lora_chartqa.py --train /data/chartqa/train_augmented.json \
        --val /data/chartqa/val_human.json --images /data/chartqa/png --out runs/llava16_chartqa_lora
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llava-hf/llava-v1.6-mistral-7b-hf")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    return p.parse_args()


PROMPT = "[INST] <image>\nAnswer the question with a single word or number. {q} [/INST]"


class ChartQA(Dataset):
    def __init__(self, path, image_dir):
        self.rows = json.load(open(path))
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_dir, r["imgname"])).convert("RGB")
        return img, r["query"], str(r["label"])


class TrainCollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        images = [b[0] for b in batch]
        prompts = [PROMPT.format(q=b[1]) for b in batch]
        texts = [p + " " + b[2] + self.processor.tokenizer.eos_token for p, b in zip(prompts, batch)]
        enc = self.processor(images=images, text=texts, padding=True, return_tensors="pt")
        labels = enc["input_ids"].clone()
        for j, p in enumerate(prompts):
            n = len(self.processor(images=images[j], text=p, return_tensors="pt")["input_ids"][0])
            pad = (enc["attention_mask"][j] == 0).sum().item() if self.processor.tokenizer.padding_side == "left" else 0
            labels[j, : pad + n] = -100
        labels[enc["attention_mask"] == 0] = -100
        enc["labels"] = labels
        return enc


def relaxed_match(pred, target, tol=0.05):
    pred, target = pred.strip().rstrip(".").lower(), target.strip().lower()
    try:
        p, t = float(pred.rstrip("%")), float(target.rstrip("%"))
        return abs(p - t) <= tol * abs(t) if t != 0 else p == t
    except ValueError:
        return pred == target


@torch.no_grad()
def evaluate(model, processor, loader, device, max_new_tokens):
    model.eval()
    correct = torch.zeros(2, device=device)
    for images, qs, answers in loader:
        enc = processor(images=list(images), text=[PROMPT.format(q=q) for q in qs], padding=True,
                        return_tensors="pt").to(device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        outs = processor.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for o, a in zip(outs, answers):
            correct[0] += float(relaxed_match(re.split(r"\n", o)[0], a))
        correct[1] += len(answers)
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = LlavaNextProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "left"  # batched generate in eval
    model = LlavaNextForConditionalGeneration.from_pretrained(
        args.model, torch_dtype=torch.bfloat16, device_map="auto", low_cpu_mem_usage=True)
    model.vision_tower.requires_grad_(False)
    model.multi_modal_projector.requires_grad_(False)

    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, bias="none",
                          target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                          task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    ddp_model = DDP(model, device_ids=[local_rank])

    train_ds = ChartQA(args.train, args.images)
    val_ds = ChartQA(args.val, args.images)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=TrainCollator(processor), num_workers=4, drop_last=True)
    # strided shard without padding so each val question is counted exactly once in the all_reduce
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), dist.get_world_size())))
    val_loader = DataLoader(val_shard, batch_size=8, shuffle=False,
                            collate_fn=lambda b: tuple(zip(*b)), num_workers=2)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * total), total)

    best = -1.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            last = (i + 1) % args.grad_accum == 0
            ctx = ddp_model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = ddp_model(**batch).loss / args.grad_accum
                loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if rank == 0 and step % 20 == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {loss.item() * args.grad_accum:.4f}", flush=True)

        acc = evaluate(model, processor, val_loader, device, args.max_new_tokens)
        if rank == 0:
            print(f"epoch {epoch} relaxed accuracy {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                model.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
