"""Stage-2 visual instruction tuning with LoRA on the LLM, DeepSpeed ZeRO-3.

The projector from stage 1 is loaded and trained fully; the LLM gets LoRA
adapters; the CLIP tower is frozen. Launch with the deepspeed launcher.
"""
import argparse
import copy
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor,
                          CLIPVisionModel, get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the human's questions.")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="lmsys/vicuna-7b-v1.5")
    parser.add_argument("--vision_tower", default="openai/clip-vit-large-patch14-336")
    parser.add_argument("--pretrain_mm_projector", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--image_folder", required=True)
    parser.add_argument("--output_dir", default="checkpoints/llava-7b-lora")
    parser.add_argument("--per_device_batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--mm_projector_lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--lora_r", type=int, default=128)
    parser.add_argument("--lora_alpha", type=int, default=256)
    parser.add_argument("--save_steps", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def tokenize_with_image(prompt, tokenizer):
    chunks = [tokenizer(c, add_special_tokens=False).input_ids for c in prompt.split("<image>")]
    ids = []
    for i, c in enumerate(chunks):
        if i > 0:
            ids.append(IMAGE_TOKEN_INDEX)
        ids.extend(c)
    return ids


def build_example(conversations, tokenizer, max_len):
    input_ids = [tokenizer.bos_token_id] + tokenize_with_image(SYSTEM + " ", tokenizer)
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn in conversations:
        if turn["from"] == "human":
            ids = tokenize_with_image("USER: " + turn["value"] + " ASSISTANT:", tokenizer)
            input_ids += ids
            labels += [IGNORE_INDEX] * len(ids)
        else:
            ids = tokenizer(turn["value"] + tokenizer.eos_token, add_special_tokens=False).input_ids
            input_ids += ids
            labels += copy.deepcopy(ids)
    return input_ids[:max_len], labels[:max_len]


class InstructDataset(Dataset):
    def __init__(self, path, image_folder, tokenizer, processor, max_len):
        self.items = json.load(open(path))
        self.image_folder, self.tokenizer, self.processor, self.max_len = image_folder, tokenizer, processor, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        image = Image.open(os.path.join(self.image_folder, item["image"])).convert("RGB")
        pixel_values = self.processor(image, return_tensors="pt")["pixel_values"][0]
        ids, labels = build_example(item["conversations"], self.tokenizer, self.max_len)
        return torch.tensor(ids), torch.tensor(labels), pixel_values


def make_collate(pad_id):
    def collate(batch):
        ids, labels, pixels = zip(*batch)
        ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
        labels = nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
        mask = ids.ne(pad_id)
        return dict(input_ids=ids, labels=labels, attention_mask=mask, pixel_values=torch.stack(pixels))
    return collate


class LlavaLora(nn.Module):
    def __init__(self, llm, vision_tower):
        super().__init__()
        self.llm = llm
        self.vision_tower = vision_tower
        d_v, d_l = vision_tower.config.hidden_size, llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(d_v, d_l), nn.GELU(), nn.Linear(d_l, d_l))

    def forward(self, input_ids, labels, attention_mask, pixel_values):
        with torch.no_grad():
            feats = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        image_features = self.mm_projector(feats)
        embed = self.llm.get_input_embeddings()
        embeds, labs = [], []
        for b in range(input_ids.size(0)):
            ids, lab = input_ids[b][attention_mask[b]], labels[b][attention_mask[b]]
            p = (ids == IMAGE_TOKEN_INDEX).nonzero()[0].item()
            embeds.append(torch.cat([embed(ids[:p]), image_features[b], embed(ids[p + 1:])]))
            labs.append(torch.cat([lab[:p], lab.new_full((image_features.size(1),), IGNORE_INDEX), lab[p + 1:]]))
        max_len = max(e.size(0) for e in embeds)
        x = embeds[0].new_zeros(len(embeds), max_len, embeds[0].size(-1))
        y = labels.new_full((len(embeds), max_len), IGNORE_INDEX)
        m = input_ids.new_zeros(len(embeds), max_len)
        for b, (e, l) in enumerate(zip(embeds, labs)):
            x[b, : e.size(0)] = e
            y[b, : l.size(0)] = l
            m[b, : e.size(0)] = 1
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y)


def save_trainable(engine, output_dir):
    model = engine.module
    lora_state = get_peft_model_state_dict(model.llm)
    projector_state = {k: v.detach().cpu() for k, v in model.mm_projector.state_dict().items()}
    if dist.get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        model.llm.save_pretrained(output_dir, state_dict=lora_state)
        torch.save(projector_state, os.path.join(output_dir, "mm_projector.bin"))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    world_size = dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=False)
    tokenizer.pad_token = tokenizer.unk_token
    processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    llm = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16)
    llm = get_peft_model(llm, LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16)
    vision.requires_grad_(False)

    model = LlavaLora(llm, vision)
    proj_state = torch.load(args.pretrain_mm_projector, map_location="cpu")
    proj_state = {k.split("mm_projector.")[-1]: v for k, v in proj_state.items()}
    model.mm_projector.load_state_dict(proj_state)
    model.mm_projector.to(torch.bfloat16)

    dataset = InstructDataset(args.data_path, args.image_folder, tokenizer, processor, args.max_len)
    sampler = DistributedSampler(dataset, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.per_device_batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, collate_fn=make_collate(tokenizer.pad_token_id))

    param_groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and "mm_projector" not in n],
         "lr": args.lr},
        {"params": list(model.mm_projector.parameters()), "lr": args.mm_projector_lr},
    ]
    optimizer = torch.optim.AdamW(param_groups, weight_decay=0.0)
    steps = math.ceil(len(loader) / args.grad_accum) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * steps), steps)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.per_device_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000000,
    }
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    if dist.get_rank() == 0:
        print(f"world={world_size} global batch={args.per_device_batch_size * args.grad_accum * world_size} "
              f"optimizer steps={steps}")

    step, micro = 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.grad_accum == 0:
                step += 1
                if step % 10 == 0:
                    avg = loss.detach().clone()
                    dist.all_reduce(avg)
                    if dist.get_rank() == 0:
                        print(f"epoch {epoch} step {step}/{steps} loss {avg.item() / world_size:.4f} "
                              f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
                if step % args.save_steps == 0:
                    save_trainable(engine, os.path.join(args.output_dir, f"checkpoint-{step}"))

    save_trainable(engine, args.output_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
