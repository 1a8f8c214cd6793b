<?xml version="1.0" encoding="utf-8"?>
<!DOCTYPE TS>
<TS version="2.1" language="zh_CN">
<context>
    <name>About</name>
    <message>
        <location filename="../app.py" line="+63"/>
        <source>The demo model: SmolLM2-135M-Instruct, Apache-2.0</source>
        <translation>演示模型：SmolLM2-135M-Instruct，Apache-2.0</translation>
    </message>
</context>
<context>
    <name>Atlas</name>
    <message>
        <location filename="../inspector/common.py" line="+139"/>
        <source>atlas: not mapped</source>
        <translation>图谱：未收录</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>atlas: never chosen by the probes</source>
        <translation>图谱：从未被探针选中</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>atlas topic: {topic} (specialisation {specialisation:.2f}, {n} probe selections)</source>
        <translation>图谱话题：{topic}（专精度 {specialisation:.2f}，被探针选中 {n} 次）</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>layer {layer}, expert {expert}</source>
        <translation>第 {layer} 层，专家 {expert}</translation>
    </message>
</context>
<context>
    <name>AtlasView</name>
    <message>
        <location filename="../inspector/atlas.py" line="+51"/>
        <source>This model has no atlas yet. Computing it routes a set of probe prompts on a dozen topics (Python, SQL, mathematics, law, French, ...) through the model and records which experts each topic uses.</source>
        <translation>此模型还没有图谱。计算图谱会让一组涵盖十余个话题（Python、SQL、数学、法律、法语……）的探针提示词流经模型，并记录每个话题用到哪些专家。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>The atlas maps the experts of a Mixture-of-Experts model: load one to see or compute its atlas.</source>
        <translation>图谱描绘混合专家（MoE）模型的各个专家：请加载一个 MoE 模型，以查看或计算它的图谱。</translation>
    </message>
    <message>
        <location line="+22"/>
        <source>the Qt platform &apos;{platform}&apos; cannot show OpenGL widgets</source>
        <translation>Qt 平台“{platform}”无法显示 OpenGL 控件</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>no OpenGL context on the Qt platform &apos;{platform}&apos;</source>
        <translation>Qt 平台“{platform}”上没有 OpenGL 上下文</translation>
    </message>
    <message>
        <location line="+8"/>
        <source>an OpenGL context exists on the Qt platform &apos;{platform}&apos; but cannot be made current</source>
        <translation>Qt 平台“{platform}”上有 OpenGL 上下文，但无法将其设为当前上下文</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>vispy cannot draw with PySide6 ({why})</source>
        <translation>vispy 无法通过 PySide6 绘图（{why}）</translation>
    </message>
    <message>
        <location line="+144"/>
        <source>Compute atlas</source>
        <translation>计算图谱</translation>
    </message>
    <message>
        <location line="+6"/>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <location line="+80"/>
        <source>computing the atlas: {percent}%</source>
        <translation>正在计算图谱：{percent}%</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>computing the atlas: {percent}%, about {s} s left</source>
        <translation>正在计算图谱：{percent}%，约剩 {s} 秒</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>computing the atlas: {percent}%, about {m} min {s} s left</source>
        <translation>正在计算图谱：{percent}%，约剩 {m} 分 {s} 秒</translation>
    </message>
    <message>
        <location line="+89"/>
        <source>The 3D atlas needs OpenGL: {why}. The Brain tab shows the same experts; hover a cell there for its atlas topic.</source>
        <translation>三维图谱需要 OpenGL：{why}。“大脑”标签页显示的是同样的专家，将鼠标悬停在其中的格子上即可看到它的图谱话题。</translation>
    </message>
    <message>
        <location line="+121"/>
        <source>selected: {expert}</source>
        <translation>已选中：{expert}</translation>
    </message>
</context>
<context>
    <name>BackgroundJob</name>
    <message>
        <location filename="../first_run.py" line="+115"/>
        <source>cancelled; asking again starts over where it can</source>
        <translation>已取消；再次请求时会尽量从中断处继续</translation>
    </message>
    <message>
        <location filename="../models.py" line="+126"/>
        <source>cancelled</source>
        <translation>已取消</translation>
    </message>
    <message>
        <location line="+69"/>
        <source>the conversion was cancelled; running it again resumes it</source>
        <translation>转换已取消；再次运行会从中断处继续</translation>
    </message>
</context>
<context>
    <name>BrainLegend</name>
    <message>
        <location filename="../inspector/brain_legend.py" line="+46"/>
        <source>Tier and heat</source>
        <translation>层级与热度</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Topic</source>
        <translation>话题</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Recency</source>
        <translation>距上次路由</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Read-ahead outcome</source>
        <translation>预取结果</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>What a cell&apos;s colour shows</source>
        <translation>格子的颜色所表示的内容</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Unticked, the tier&apos;s experts are dimmed</source>
        <translation>取消勾选后，该层级的专家会变暗</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Dim the experts whose strongest atlas topic is another</source>
        <translation>将最强图谱话题不是此话题的专家变暗</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Colour:</source>
        <translation>颜色：</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Show:</source>
        <translation>显示：</translation>
    </message>
    <message>
        <location line="+86"/>
        <source>brighter = routed more lately</source>
        <translation>越亮 = 最近被路由越多</translation>
    </message>
    <message>
        <location line="+3"/>
        <location line="+4"/>
        <source>no atlas topic</source>
        <translation>无图谱话题</translation>
    </message>
    <message>
        <location line="-4"/>
        <source>no atlas yet: compute one in the Atlas tab</source>
        <translation>暂无图谱：可在“图谱”标签页中计算</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>chosen by the latest token</source>
        <translation>被最新的词元选中</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>a while ago</source>
        <translation>一段时间之前</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>longest unchosen</source>
        <translation>最久未被选中</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>never chosen</source>
        <translation>从未被选中</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>brighter = chosen more recently (log scale)</source>
        <translation>越亮 = 越近被选中（对数刻度）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>reads ahead all used</source>
        <translation>预取全部用到</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>half used</source>
        <translation>用到一半</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>all wasted</source>
        <translation>全部浪费</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>no reads ahead</source>
        <translation>没有预取</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>no expert cache counters: its experts are not streamed</source>
        <translation>没有专家缓存计数：此模型的专家不是流式读取的</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>current token</source>
        <translation>当前词元</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>read from disk (replay)</source>
        <translation>从磁盘读取（回放）</translation>
    </message>
    <message>
        <location line="+30"/>
        <source>all topics</source>
        <translation>全部话题</translation>
    </message>
</context>
<context>
    <name>BrainView</name>
    <message>
        <location filename="../inspector/brain.py" line="+84"/>
        <source>layer</source>
        <translation>层</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>expert</source>
        <translation>专家</translation>
    </message>
    <message>
        <location line="+55"/>
        <source>no experts: a dense model, or no model loaded</source>
        <translation>没有专家：这是稠密模型，或尚未加载模型</translation>
    </message>
    <message>
        <location line="+11"/>
        <source>{a} experts chosen more in A, {b} in B, {same} as often</source>
        <translation>{a} 个专家在 A 中被选得更多，{b} 个在 B 中更多，{same} 个一样多</translation>
    </message>
    <message>
        <location line="+42"/>
        <source>tiers not reported</source>
        <translation>未报告存储层级</translation>
    </message>
    <message>
        <location line="+50"/>
        <source>tier: {tier}</source>
        <translation>层级：{tier}</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>tier: not reported</source>
        <translation>层级：未报告</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>selections: {heat} (recent, decayed); routed by the current token</source>
        <translation>选中次数：{heat}（近期，按时间衰减）；当前词元路由到了它</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>selections: {heat} (recent, decayed)</source>
        <translation>选中次数：{heat}（近期，按时间衰减）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>atlas: none yet</source>
        <translation>图谱：暂无</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>last chosen: never</source>
        <translation>上次被选中：从未</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>last chosen: {n} tokens ago</source>
        <translation>上次被选中：{n} 个词元之前</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>read ahead: {used} used, {wasted} wasted</source>
        <translation>预取：已用 {used}，浪费 {wasted}</translation>
    </message>
</context>
<context>
    <name>BudgetBar</name>
    <message>
        <location filename="../inspector/budget.py" line="+25"/>
        <source>dense weights</source>
        <translation>稠密权重</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>weights held whatever the budget: attention, norms, embeddings</source>
        <translation>无论预算多少都常驻的权重：注意力、归一化、嵌入</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>cached experts</source>
        <translation>已缓存专家</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>routed experts in memory, pinned or cached</source>
        <translation>内存中的路由专家（固定或已缓存）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>KV cache</source>
        <translation>KV 缓存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>keys and values of the context, and earlier chats&apos; prefixes kept for reuse</source>
        <translation>上下文的键和值，以及为复用而保留的先前对话前缀</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>scratch</source>
        <translation>临时缓冲</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>the rest: working buffers, allocator slack and the compiled kernels</source>
        <translation>其余部分：工作缓冲区、分配器余量和已编译的内核</translation>
    </message>
    <message>
        <location line="+52"/>
        <source>no memory budget (the whole model is resident)</source>
        <translation>无内存预算（整个模型常驻内存）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>model memory {size}, no budget (the whole model is resident)</source>
        <translation>模型内存 {size}，无预算（整个模型常驻内存）</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>budget {size} (model memory not reported)</source>
        <translation>预算 {size}（未报告模型内存）</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>model memory {size} of the {budget} budget ({share})</source>
        <translation>模型内存 {size}，预算 {budget}（{share}）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>model memory {size} of the {budget} budget ({share}): over by {over}, the most in {part} ({part_size})</source>
        <translation>模型内存 {size}，预算 {budget}（{share}）：超出 {over}，占用最多的是：{part}（{part_size}）</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>model memory is not reported (no RSS gauge)</source>
        <translation>未报告模型内存（没有 RSS 指标）</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>  of which planned working buffers: {size} MB</source>
        <translation>  其中计划的工作缓冲区：{size} MB</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>model memory: {size} MB</source>
        <translation>模型内存：{size} MB</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>budget: {size} MB</source>
        <translation>预算：{size} MB</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>no budget</source>
        <translation>无预算</translation>
    </message>
</context>
<context>
    <name>CacheView</name>
    <message>
        <location filename="../inspector/cache.py" line="+37"/>
        <source>hit rate (%)</source>
        <translation>命中率（%）</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>expert cache</source>
        <translation>专家缓存</translation>
    </message>
    <message>
        <location line="+11"/>
        <source>live hit rate</source>
        <translation>实时命中率</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>its policy, replayed</source>
        <translation>其策略（回放）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Belady&apos;s optimum</source>
        <translation>Belady 最优</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>share of the optimum</source>
        <translation>占最优的比例</translation>
    </message>
    <message>
        <location line="+46"/>
        <source>no expert cache: load a model with --max-memory to stream its experts</source>
        <translation>没有专家缓存：用 --max-memory 加载模型，让它的专家从磁盘流式读取</translation>
    </message>
    <message>
        <location line="+24"/>
        <source>no layer step recorded yet: the meter starts with the first answer</source>
        <translation>尚未记录任何层步骤：第一次回答时开始统计</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>replaying {requests} expert requests of the last {steps} layer steps...</source>
        <translation>正在回放最近 {steps} 个层步骤中的 {requests} 次专家请求……</translation>
    </message>
    <message>
        <location line="+32"/>
        <source>expert cache ({unit})</source>
        <translation>专家缓存（{unit}）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>over the last {steps} layer steps ({requests} expert requests); the cache holds {size} now (the line). Replays start cold: they can read below the live rate.</source>
        <translation>基于最近 {steps} 个层步骤（{requests} 次专家请求）；缓存当前容量为 {size}（竖线处）。回放从空缓存开始，因此可能低于实时命中率。</translation>
    </message>
</context>
<context>
    <name>ChatPanel</name>
    <message>
        <location filename="../chat.py" line="+126"/>
        <source>Cancel edit</source>
        <translation>取消编辑</translation>
    </message>
    <message>
        <location line="+14"/>
        <source>System prompt</source>
        <translation>系统提示词</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Instructions the model reads before the conversation (optional)</source>
        <translation>模型在对话开始前读取的指令（可选）</translation>
    </message>
    <message>
        <location line="+6"/>
        <source>how freely tokens are chosen; 0 is greedy: the likeliest token every time</source>
        <translation>选择词元的自由程度；0 即贪婪解码：每次都选最可能的词元</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Greedy</source>
        <translation>贪婪</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>always the likeliest token (temperature 0): the same answer every time</source>
        <translation>总是选最可能的词元（温度 0）：每次回答都相同</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>nucleus sampling: keep the likeliest tokens holding this much probability (1 is off)</source>
        <translation>核采样：只保留累计概率达到此值的最可能词元（1 表示关闭）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>makes tokens already in the conversation less likely (1 is off; small models repeat themselves less at 1.1)</source>
        <translation>降低对话中已出现词元的概率（1 表示关闭；小模型在 1.1 时更少重复）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>the longest answer, in tokens</source>
        <translation>回答的最大长度（词元数）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Stop loops</source>
        <translation>停止循环</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>stop an answer that starts repeating itself, and say so</source>
        <translation>回答开始自我重复时停止它，并给出说明</translation>
    </message>
    <message>
        <location line="+14"/>
        <source>Ask something (Enter sends, Shift+Enter for a new line)</source>
        <translation>输入问题（回车发送，Shift+回车换行）</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Send</source>
        <translation>发送</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Stop</source>
        <translation>停止</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Regenerate</source>
        <translation>重新生成</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Preset</source>
        <translation>预设</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Drafting</source>
        <translation>推测解码</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Temperature</source>
        <translation>温度</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Top-p</source>
        <translation>Top-p</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Repeat penalty</source>
        <translation>重复惩罚</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Max tokens</source>
        <translation>最大词元数</translation>
    </message>
    <message>
        <location line="+40"/>
        <source>Open a model to chat (File ▸ Open)</source>
        <translation>打开一个模型即可聊天（文件 ▸ 打开）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>{name} has no chat template: it cannot chat</source>
        <translation>{name} 没有聊天模板：无法聊天</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Ready: {name} (the small demo model)</source>
        <translation>就绪：{name}（小型演示模型）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Ready: {name}</source>
        <translation>就绪：{name}</translation>
    </message>
    <message>
        <location line="+56"/>
        <source>Wait for the answer to end, or stop it, before editing a question</source>
        <translation>请等回答结束或将其停止后，再编辑问题</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Editing question {n}: Send starts a branch here; the conversation after it is kept as “{title} (branch)”. Escape cancels.</source>
        <translation>正在编辑第 {n} 个问题：点击发送会从这里开启一个分支，之后的对话将另存为“{title} (branch)”。按 Esc 取消。</translation>
    </message>
    <message>
        <location line="+21"/>
        <source>Not renamed: {why}</source>
        <translation>未重命名：{why}</translation>
    </message>
    <message>
        <location line="+17"/>
        <location line="+17"/>
        <source>Not exported: {why}</source>
        <translation>未导出：{why}</translation>
    </message>
    <message>
        <location line="-14"/>
        <source>Nothing to export yet: ask a question first</source>
        <translation>还没有可导出的内容：请先提一个问题</translation>
    </message>
    <message>
        <location line="+16"/>
        <source>Exported “{title}” as {format} to {path}</source>
        <translation>已将“{title}”以 {format} 格式导出到 {path}</translation>
    </message>
    <message>
        <location line="+11"/>
        <source>Stopping…</source>
        <translation>正在停止…</translation>
    </message>
    <message>
        <location line="+21"/>
        <source>Wait for the answer to end, or stop it, before regenerating another</source>
        <translation>请等回答结束或将其停止后，再重新生成其他回答</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Not regenerated: {why}</source>
        <translation>未重新生成：{why}</translation>
    </message>
    <message>
        <location line="+28"/>
        <source>Preset “{name}”: temperature {t:g}, top-p {p:g}, repeat penalty {r:g}</source>
        <translation>预设“{name}”：温度 {t:g}，top-p {p:g}，重复惩罚 {r:g}</translation>
    </message>
    <message>
        <location line="+42"/>
        <source>Reading the prompt…</source>
        <translation>正在读取提示词…</translation>
    </message>
    <message>
        <location line="+18"/>
        <source>Stopping: the answer repeats itself…</source>
        <translation>正在停止：回答在自我重复…</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Writing… {n} tokens</source>
        <translation>正在生成… {n} 个词元</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Reading the prompt: {done}/{total} tokens</source>
        <translation>正在读取提示词：{done}/{total} 个词元</translation>
    </message>
    <message>
        <location line="+12"/>
        <source>The answer failed: {why}</source>
        <translation>回答失败：{why}</translation>
    </message>
    <message>
        <location line="+32"/>
        <source>The answer was stopped because it repeated itself ({repeats} times a stretch of {period} tokens); it is shown up to the first repeat. Regenerate, raise the temperature or the repeat penalty, or uncheck Stop loops to let it run.</source>
        <translation>回答因自我重复而被停止（一段 {period} 个词元的内容重复了 {repeats} 次）；只显示到第一次重复为止。可以重新生成、调高温度或重复惩罚，或取消勾选“停止循环”让它继续。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>The answer was stopped because it repeated itself ({repeats} times a stretch of {period} token); it is shown up to the first repeat. Regenerate, raise the temperature or the repeat penalty, or uncheck Stop loops to let it run.</source>
        <translation>回答因自我重复而被停止（一段 {period} 个词元的内容重复了 {repeats} 次）；只显示到第一次重复为止。可以重新生成、调高温度或重复惩罚，或取消勾选“停止循环”让它继续。</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Stopped: {stats}</source>
        <translation>已停止：{stats}</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Done: {stats}</source>
        <translation>完成：{stats}</translation>
    </message>
    <message>
        <location line="+81"/>
        <source>The conversation could not be saved: {why}</source>
        <translation>无法保存对话：{why}</translation>
    </message>
    <message>
        <location line="+22"/>
        <source>open a model first</source>
        <translation>请先打开一个模型</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>{name} has no chat template</source>
        <translation>{name} 没有聊天模板</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>send (Enter)</source>
        <translation>发送（回车）</translation>
    </message>
    <message>
        <location filename="../chat_options.py" line="+21"/>
        <source>This is the demo model: SmolLM2-135M, a small model upcycled into experts to show them streaming from disk. Expect simple answers, and open a bigger model for real work (File ▸ Open).</source>
        <translation>这是演示模型：SmolLM2-135M，一个被扩展（upcycle）成多个专家的小模型，用来展示专家从磁盘流式读取。它只能给出简单的回答；真正使用时请打开更大的模型（文件 ▸ 打开）。</translation>
    </message>
</context>
<context>
    <name>CompareBar</name>
    <message>
        <location filename="../inspector/compare.py" line="+47"/>
        <source>Compare answers</source>
        <translation>比较回答</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>draw two answers&apos; routing on the Brain as a difference</source>
        <translation>在“大脑”上以差异方式显示两个回答的路由</translation>
    </message>
    <message>
        <location line="+46"/>
        <source>answer {n}: tokens {first}-{last}</source>
        <translation>回答 {n}：词元 {first}-{last}</translation>
    </message>
</context>
<context>
    <name>ContextMeter</name>
    <message>
        <location filename="../context_meter.py" line="+17"/>
        <source>When it is full, the answer stops there and a question that no longer fits is refused: start a new chat, or raise Context length in Controls.</source>
        <translation>上下文满了以后，回答会在此处停止，放不下的新问题会被拒绝：请开始新的聊天，或在“控制”中调大上下文长度。</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>When it is full, the oldest tokens are dropped to make room: the model forgets the start of the conversation.</source>
        <translation>上下文满了以后，会丢弃最早的词元腾出空间：模型会忘记对话的开头。</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>When it is full, the engine keeps the first tokens, the latest ones and those that drew the most attention, and drops the rest: the model forgets parts of the conversation.</source>
        <translation>上下文满了以后，引擎会保留开头的词元、最新的词元以及获得最多注意力的词元，丢弃其余部分：模型会忘记对话的一部分。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>When it is full, the server decides: by default it stops the answer and refuses a question that no longer fits.</source>
        <translation>上下文满了以后，由服务器决定：默认会停止回答，并拒绝放不下的新问题。</translation>
    </message>
    <message>
        <location line="+78"/>
        <source>Context: no model</source>
        <translation>上下文：无模型</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Context {used} / {total}</source>
        <translation>上下文 {used} / {total}</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>The context the conversation takes, once a model is open.</source>
        <translation>打开模型后，这里显示对话占用的上下文。</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>The context holds {total} tokens; this conversation&apos;s share is counted when its next answer is written.</source>
        <translation>上下文可容纳 {total} 个词元；本对话占用的部分将在下一次回答时统计。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>This conversation takes {used} of the {total} tokens of the context ({share}): the prompt and the last answer, as the engine counted them.</source>
        <translation>本对话占用上下文 {total} 个词元中的 {used} 个（{share}）：即引擎统计的提示词和上一次回答。</translation>
    </message>
</context>
<context>
    <name>ControlsPanel</name>
    <message>
        <location filename="../controls.py" line="+65"/>
        <source>Memory budget</source>
        <translation>内存预算</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Prefetch depth</source>
        <translation>预取深度</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Context length</source>
        <translation>上下文长度</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>{n} tokens</source>
        <translation>{n} 个词元</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Reader threads</source>
        <translation>读取线程</translation>
    </message>
    <message>
        <location line="+37"/>
        <source>off</source>
        <translation>关闭</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>{n} layer</source>
        <translation>{n} 层</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>{n} layers</source>
        <translation>{n} 层</translation>
    </message>
    <message>
        <location line="+15"/>
        <source>open a model first</source>
        <translation>请先打开一个模型</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>No model loaded.</source>
        <translation>未加载模型。</translation>
    </message>
    <message>
        <location line="+123"/>
        <source>least {low}; every expert held at {high}</source>
        <translation>最少 {low}；{high} 时可容纳全部专家</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>this model has no memory budget</source>
        <translation>此模型没有内存预算</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>whole model</source>
        <translation>整个模型</translation>
    </message>
    <message>
        <location line="+10"/>
        <source>applies to the next answer&apos;s KV cache</source>
        <translation>从下一次回答的 KV 缓存起生效</translation>
    </message>
    <message>
        <location line="+10"/>
        <source>Every setting is {reason}.</source>
        <translation>所有设置都无法在此更改：{reason}。</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>No setting can change.</source>
        <translation>没有可以更改的设置。</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Experts stream from disk: a smaller budget keeps fewer in memory (more reads, more I/O wait).</source>
        <translation>专家从磁盘流式读取：预算越小，内存中保留的专家越少（读取更多，I/O 等待更长）。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Layers stream from disk; reopen the model to change its budget.</source>
        <translation>各层从磁盘流式读取；要更改预算，请重新打开模型。</translation>
    </message>
</context>
<context>
    <name>ConversationList</name>
    <message>
        <location filename="../conversation_list.py" line="+37"/>
        <source>just now</source>
        <translation>刚刚</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>{n} min ago</source>
        <translation>{n} 分钟前</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>{n} h ago</source>
        <translation>{n} 小时前</translation>
    </message>
    <message>
        <location line="+10"/>
        <source>Export conversation</source>
        <translation>导出对话</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>New chat</source>
        <translation>新聊天</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Search titles and text</source>
        <translation>搜索标题和内容</translation>
    </message>
    <message>
        <location line="+15"/>
        <source>No conversation matches.</source>
        <translation>没有匹配的对话。</translation>
    </message>
    <message>
        <location line="+34"/>
        <source>{title}
{n} messages, {when}
double-click to rename</source>
        <translation>{title}
{n} 条消息，{when}
双击可重命名</translation>
    </message>
    <message>
        <location line="+59"/>
        <source>Rename</source>
        <translation>重命名</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Export…</source>
        <translation>导出…</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Delete</source>
        <translation>删除</translation>
    </message>
</context>
<context>
    <name>ConvertDialog</name>
    <message>
        <location filename="../models.py" line="-122"/>
        <source>{name} is a Colibri container: it is quantized already, and quantizing it again would lose more precision. Convert the model it was made from (its Hugging Face folder or GGUF) instead.</source>
        <translation>{name} 是 Colibri 容器：它已经量化过，再次量化会损失更多精度。请转换它的来源模型（Hugging Face 文件夹或 GGUF 文件）。</translation>
    </message>
    <message>
        <location line="+139"/>
        <source>Convert a model</source>
        <translation>转换模型</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>a Hugging Face folder or a .gguf file</source>
        <translation>Hugging Face 文件夹或 .gguf 文件</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>e.g. 2GB: the planner picks each tensor&apos;s width</source>
        <translation>例如 2GB：由规划器为每个张量选择位宽</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>One width</source>
        <translation>统一位宽</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Fit a budget</source>
        <translation>适配预算</translation>
    </message>
    <message>
        <location line="+8"/>
        <source>Browse…</source>
        <translation>浏览…</translation>
    </message>
    <message>
        <location line="+8"/>
        <source>bits</source>
        <translation>位</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Convert</source>
        <translation>转换</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Source</source>
        <translation>来源</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Output</source>
        <translation>输出</translation>
    </message>
    <message>
        <location line="+23"/>
        <source>{path}: no such folder or file</source>
        <translation>{path}：没有这个文件夹或文件</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>choose an output folder</source>
        <translation>请选择输出文件夹</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Converting {name}…</source>
        <translation>正在转换 {name}…</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Converting</source>
        <translation>正在转换</translation>
    </message>
    <message>
        <location line="+24"/>
        <source>Cancelling at the next tensor…</source>
        <translation>将在下一个张量处取消…</translation>
    </message>
    <message>
        <location line="+38"/>
        <source>Model folder to convert</source>
        <translation>要转换的模型文件夹</translation>
    </message>
</context>
<context>
    <name>DraftingChoice</name>
    <message>
        <location filename="../chat_options.py" line="+65"/>
        <source>Off</source>
        <translation>关闭</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Prompt lookup</source>
        <translation>提示词查找</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>MTP head</source>
        <translation>MTP 头</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>speculative decoding: guess a few tokens ahead (from the conversation, or with the model&apos;s multi-token-prediction head) and verify them in one step; answers stay the same, only faster when guesses hold</source>
        <translation>推测解码：预先猜出几个词元（根据对话内容，或用模型的多词元预测头），再一步验证；回答内容不变，猜中时只会更快</translation>
    </message>
    <message>
        <location line="+21"/>
        <source>this model has no MTP head to draft with</source>
        <translation>此模型没有可用于起草的 MTP 头</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>the server at {url} drafts as it was started (colibri serve --speculative)</source>
        <translation>{url} 上的服务器按启动时的设置起草（colibri serve --speculative）</translation>
    </message>
</context>
<context>
    <name>FirstRunDialog</name>
    <message>
        <location filename="../first_run.py" line="+30"/>
        <source>Welcome to Colibri</source>
        <translation>欢迎使用 Colibri</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Get a model</source>
        <translation>获取模型</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>&lt;b&gt;No model yet.&lt;/b&gt; Colibri needs a language model to chat with.</source>
        <translation>&lt;b&gt;还没有模型。&lt;/b&gt;Colibri 需要一个语言模型才能聊天。</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>&lt;b&gt;Get another model.&lt;/b&gt; {name} stays loaded until the new one opens.</source>
        <translation>&lt;b&gt;获取另一个模型。&lt;/b&gt;在新模型打开之前，{name} 会保持加载。</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Prepare the demo model</source>
        <translation>准备演示模型</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>The demo model is the one loaded now.</source>
        <translation>当前加载的就是演示模型。</translation>
    </message>
    <message>
        <location line="+6"/>
        <source>Open a model folder…</source>
        <translation>打开模型文件夹…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Open a GGUF file…</source>
        <translation>打开 GGUF 文件…</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>a Hugging Face repo (org/name) or smollm2-135m</source>
        <translation>Hugging Face 仓库（组织/名称）或 smollm2-135m</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Pull</source>
        <translation>拉取</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Not now</source>
        <translation>以后再说</translation>
    </message>
    <message>
        <location line="+11"/>
        <source>Or a model of your own:</source>
        <translation>或使用你自己的模型：</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Or pull one by name:</source>
        <translation>或按名称拉取：</translation>
    </message>
    <message>
        <location line="+27"/>
        <source>type a model name first</source>
        <translation>请先输入模型名称</translation>
    </message>
    <message>
        <location line="-15"/>
        <source>Once: 5 to 15 minutes on a small two-core machine.</source>
        <translation>只需一次：在双核小型机器上约 5 到 15 分钟。</translation>
    </message>
    <message>
        <location line="-36"/>
        <source>Shipped with the app: no download.</source>
        <translation>随应用附带：无需下载。</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Downloads about 100 MB.</source>
        <translation>需下载约 100 MB。</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>SmolLM2-135M turned into an 8-expert Mixture-of-Experts stored at 4 bits, whose experts stream from disk.</source>
        <translation>将 SmolLM2-135M 转成 8 个专家的混合专家模型，以 4 位存储，专家从磁盘流式读取。</translation>
    </message>
    <message>
        <location line="+57"/>
        <source>Getting {name}…</source>
        <translation>正在获取 {name}…</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>Preparing the model</source>
        <translation>正在准备模型</translation>
    </message>
    <message>
        <location line="+34"/>
        <source>Cancelling at the next step…</source>
        <translation>将在下一步取消…</translation>
    </message>
    <message>
        <location line="+38"/>
        <source>Cancelled: {why}</source>
        <translation>已取消：{why}</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>It did not work: {why}</source>
        <translation>未能完成：{why}</translation>
    </message>
</context>
<context>
    <name>Inspector</name>
    <message>
        <location filename="../inspector/inspector.py" line="+56"/>
        <source>Overview</source>
        <translation>概览</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Time</source>
        <translation>耗时</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Brain</source>
        <translation>大脑</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Atlas</source>
        <translation>图谱</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Cache</source>
        <translation>缓存</translation>
    </message>
</context>
<context>
    <name>InspectorPlaceholder</name>
    <message>
        <location filename="../widgets.py" line="+65"/>
        <source>The inspector is not available ({why}).</source>
        <translation>检查器不可用（{why}）。</translation>
    </message>
</context>
<context>
    <name>Language</name>
    <message>
        <location filename="../language.py" line="+24"/>
        <source>System</source>
        <translation>跟随系统</translation>
    </message>
</context>
<context>
    <name>LibraryDialog</name>
    <message>
        <location filename="../library.py" line="+62"/>
        <source>Model library</source>
        <translation>模型库</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Name</source>
        <translation>名称</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Family</source>
        <translation>架构</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Parameters</source>
        <translation>参数量</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Bits</source>
        <translation>位宽</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Size</source>
        <translation>大小</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Kind</source>
        <translation>类型</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Atlas</source>
        <translation>图谱</translation>
    </message>
    <message>
        <location line="+12"/>
        <source>Open</source>
        <translation>打开</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Convert…</source>
        <translation>转换…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Reveal</source>
        <translation>打开所在位置</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Delete…</source>
        <translation>删除…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Refresh</source>
        <translation>刷新</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>{n} model(s) in {folder} (File ▸ Settings changes the folder)</source>
        <translation>{folder} 中有 {n} 个模型（可在“文件 ▸ 设置”中更改文件夹）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>yes</source>
        <translation>有</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>container</source>
        <translation>容器</translation>
    </message>
    <message>
        <location line="+43"/>
        <source>No file manager answered: the model is in {path}</source>
        <translation>没有文件管理器响应：模型位于 {path}</translation>
    </message>
    <message>
        <location line="+8"/>
        <source>{name} is the model loaded now: open another before deleting it</source>
        <translation>{name} 是当前加载的模型：请先打开其他模型再删除它</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Delete a model</source>
        <translation>删除模型</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Delete {name} ({size}) from the disk? This cannot be undone.</source>
        <translation>要从磁盘上删除 {name}（{size}）吗？此操作无法撤销。</translation>
    </message>
    <message>
        <location line="+21"/>
        <source>{name} was not deleted: {why}</source>
        <translation>未能删除 {name}：{why}</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Deleted {name}</source>
        <translation>已删除 {name}</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>a container is quantized already: convert the model it was made from</source>
        <translation>容器已经量化过：请转换它的来源模型</translation>
    </message>
</context>
<context>
    <name>MainWindow</name>
    <message>
        <location filename="../app.py" line="+55"/>
        <source>Conversations</source>
        <translation>对话</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Controls</source>
        <translation>控制</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Inspector</source>
        <translation>检查器</translation>
    </message>
    <message>
        <location line="+24"/>
        <source>&amp;File</source>
        <translation>文件(&amp;F)</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Model library…</source>
        <translation>模型库…</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Get a model…</source>
        <translation>获取模型…</translation>
    </message>
    <message>
        <location line="+6"/>
        <source>Export conversation…</source>
        <translation>导出对话…</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Settings…</source>
        <translation>设置…</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Quit</source>
        <translation>退出</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>&amp;Chat</source>
        <translation>聊天(&amp;C)</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>New chat</source>
        <translation>新聊天</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Send</source>
        <translation>发送</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Stop the answer</source>
        <translation>停止回答</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Regenerate the last answer</source>
        <translation>重新生成最后的回答</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Search conversations</source>
        <translation>搜索对话</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>&amp;View</source>
        <translation>视图(&amp;V)</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Theme</source>
        <translation>主题</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>&amp;Help</source>
        <translation>帮助(&amp;H)</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Keyboard shortcuts</source>
        <translation>键盘快捷键</translation>
    </message>
    <message>
        <location line="+3"/>
        <location line="+479"/>
        <source>About Colibri</source>
        <translation>关于 Colibri</translation>
    </message>
    <message>
        <location line="-423"/>
        <source>{label} · compute threads change when a model is next opened</source>
        <translation>{label} · 计算线程将在下次打开模型时更改</translation>
    </message>
    <message>
        <location line="+36"/>
        <location line="+154"/>
        <source>No model</source>
        <translation>无模型</translation>
    </message>
    <message>
        <location line="-148"/>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <location line="+44"/>
        <source>the model is served by {url}; open, pull or convert models on that machine</source>
        <translation>模型由 {url} 提供；请在那台机器上打开、拉取或转换模型</translation>
    </message>
    <message>
        <location line="+9"/>
        <location line="+53"/>
        <source>Connecting to {url}…</source>
        <translation>正在连接 {url}…</translation>
    </message>
    <message>
        <location line="-43"/>
        <source>the atlas of a served model is computed where it runs: `colibri atlas MODEL` on the machine of {url}, then reconnect</source>
        <translation>服务端模型的图谱在其运行的机器上计算：在 {url} 所在的机器上运行 `colibri atlas MODEL`，然后重新连接</translation>
    </message>
    <message>
        <location line="+9"/>
        <source>● live: {url}</source>
        <translation>● 已连接：{url}</translation>
    </message>
    <message>
        <location line="+36"/>
        <source>Loading {name}…</source>
        <translation>正在加载 {name}…</translation>
    </message>
    <message>
        <location line="+40"/>
        <source>Open a Mixture-of-Experts model before computing its atlas.</source>
        <translation>请先打开一个混合专家（MoE）模型，再计算它的图谱。</translation>
    </message>
    <message>
        <location line="+80"/>
        <source>{why}

{name} is still loaded.</source>
        <translation>{why}

{name} 仍然处于加载状态。</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>experts stream from disk</source>
        <translation>专家从磁盘流式读取</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>layers stream from disk</source>
        <translation>各层从磁盘流式读取</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>held in memory</source>
        <translation>全部在内存中</translation>
    </message>
    <message>
        <location line="-51"/>
        <source>{name} · {architecture} · {how} · served by {url}</source>
        <translation>{name} · {architecture} · {how} · 由 {url} 提供</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>Loading cancelled</source>
        <translation>已取消加载</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Not connected to {url} (retrying in the background)</source>
        <translation>未连接到 {url}（正在后台重试）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>The server cannot be reached</source>
        <translation>无法连接服务器</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>No model (the last one failed to load)</source>
        <translation>无模型（上一个模型加载失败）</translation>
    </message>
    <message>
        <location line="-121"/>
        <location line="+122"/>
        <location line="+11"/>
        <source>The model could not be loaded</source>
        <translation>无法加载模型</translation>
    </message>
    <message>
        <location line="+50"/>
        <source>The atlas cannot be shown</source>
        <translation>无法显示图谱</translation>
    </message>
    <message>
        <location line="+6"/>
        <source>The atlas could not be computed</source>
        <translation>无法计算图谱</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>The conversation cannot be opened</source>
        <translation>无法打开对话</translation>
    </message>
    <message>
        <location line="+68"/>
        <source>Colibri runs language models, above all Mixture-of-Experts models, on computers whose memory cannot hold them, streaming experts from disk under a memory budget.</source>
        <translation>Colibri 可以在内存装不下模型的电脑上运行语言模型（尤其是混合专家模型）：在内存预算之内，从磁盘流式读取专家。</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Licence: {licence}.</source>
        <translation>许可证：{licence}。</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Built on:</source>
        <translation>基于以下项目：</translation>
    </message>
</context>
<context>
    <name>ModelActions</name>
    <message>
        <location filename="../models.py" line="+27"/>
        <source>Open model folder…</source>
        <translation>打开模型文件夹…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Open GGUF file…</source>
        <translation>打开 GGUF 文件…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Convert…</source>
        <translation>转换…</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Recent models</source>
        <translation>最近的模型</translation>
    </message>
    <message>
        <location line="+32"/>
        <source>(none yet)</source>
        <translation>（暂无）</translation>
    </message>
    <message>
        <location line="+8"/>
        <source>Open a model folder (Hugging Face or container)</source>
        <translation>打开模型文件夹（Hugging Face 或容器）</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Open a GGUF file</source>
        <translation>打开 GGUF 文件</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>GGUF models (*.gguf)</source>
        <translation>GGUF 模型 (*.gguf)</translation>
    </message>
</context>
<context>
    <name>OverviewView</name>
    <message>
        <location filename="../inspector/overview.py" line="+37"/>
        <source>Decode speed</source>
        <translation>解码速度</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>decoded tokens per second over the recent tokens</source>
        <translation>最近词元的每秒解码词元数</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Time to first token</source>
        <translation>首词元延迟</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>from the request to its first token, prompt included</source>
        <translation>从请求到第一个词元的时间，包括处理提示词</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Expert hit rate</source>
        <translation>专家命中率</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>routed experts found in memory (pinned or cached), not read from disk, since the model was loaded</source>
        <translation>自模型加载以来，在内存中（固定或已缓存）找到、无需从磁盘读取的路由专家比例</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Hit rate, last {n} tokens</source>
        <translation>命中率（最近 {n} 个词元）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>the same over the latest tokens (prompt and decoded): how the cache serves now</source>
        <translation>同上，但只统计最新的词元（提示词和解码）：反映缓存当前的表现</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Model memory</source>
        <translation>模型内存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>process RSS minus the baseline: weights, expert cache, KV cache and buffers, what the memory budget covers</source>
        <translation>进程 RSS 减去基线：权重、专家缓存、KV 缓存和缓冲区，即内存预算所涵盖的部分</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Baseline</source>
        <translation>基线</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>process RSS before the model was loaded: the interpreter and libraries, outside the budget</source>
        <translation>加载模型前的进程 RSS：解释器和各种库，不计入预算</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>KV cache</source>
        <translation>KV 缓存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>memory of the attention keys and values</source>
        <translation>注意力键和值占用的内存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Tokens</source>
        <translation>词元</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>decoded and prompt tokens of this generation</source>
        <translation>本次生成的解码词元和提示词词元</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Read from disk</source>
        <translation>磁盘读取量</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>expert bytes read from disk</source>
        <translation>从磁盘读取的专家字节数</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Prefetch used / issued</source>
        <translation>预取（已用 / 发出）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>experts read ahead of time that a token then used</source>
        <translation>提前读取、随后被词元用到的专家</translation>
    </message>
    <message>
        <location line="+58"/>
        <location line="+111"/>
        <source>{unit} in memory</source>
        <translation>内存中（{unit}）</translation>
    </message>
    <message>
        <location line="-110"/>
        <location line="+111"/>
        <source>{unit} on disk</source>
        <translation>磁盘上（{unit}）</translation>
    </message>
    <message>
        <location line="-111"/>
        <source>seconds ago</source>
        <translation>秒前</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>model memory</source>
        <translation>模型内存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>budget</source>
        <translation>预算</translation>
    </message>
    <message>
        <location line="+82"/>
        <source>{rate} ({n} tokens)</source>
        <translation>{rate}（{n} 个词元）</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>{decoded} decoded, {prompt} prompt</source>
        <translation>解码 {decoded}，提示词 {prompt}</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>, {n} wasted</source>
        <translation>，浪费 {n}</translation>
    </message>
</context>
<context>
    <name>PresetPicker</name>
    <message>
        <location filename="../presets.py" line="+68"/>
        <source>Default</source>
        <translation>默认</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Greedy</source>
        <translation>贪婪</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Creative</source>
        <translation>创意</translation>
    </message>
    <message>
        <location line="+91"/>
        <source>a system prompt and sampling under a name: choosing one fills the fields below (built-in ones leave the system prompt as it is)</source>
        <translation>命名保存的系统提示词和采样设置：选择后会填入下方各栏（内置预设不改动系统提示词）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Save…</source>
        <translation>保存…</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>keep the system prompt and sampling below as a preset</source>
        <translation>将下方的系统提示词和采样设置保存为预设</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Delete</source>
        <translation>删除</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>forget the preset chosen (built-in ones stay)</source>
        <translation>删除所选预设（内置预设会保留）</translation>
    </message>
    <message>
        <location line="+42"/>
        <source>The preset was not saved: {why}</source>
        <translation>预设未保存：{why}</translation>
    </message>
    <message>
        <location line="+15"/>
        <source>The preset was not deleted: {why}</source>
        <translation>预设未删除：{why}</translation>
    </message>
    <message>
        <location line="+10"/>
        <source>Save preset</source>
        <translation>保存预设</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Name of the preset (the system prompt and sampling are kept):</source>
        <translation>预设名称（将保存系统提示词和采样设置）：</translation>
    </message>
    <message>
        <location line="+21"/>
        <source>Custom</source>
        <translation>自定义</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>temperature {t:g}, top-p {p:g}, repeat penalty {r:g}</source>
        <translation>温度 {t:g}，top-p {p:g}，重复惩罚 {r:g}</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>system prompt: {s}</source>
        <translation>系统提示词：{s}</translation>
    </message>
</context>
<context>
    <name>Presets</name>
    <message>
        <location line="-184"/>
        <source>a preset needs a name: type a few words</source>
        <translation>预设需要一个名称：请输入几个字</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>a preset&apos;s name has at most {n} characters</source>
        <translation>预设名称最多 {n} 个字符</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>“{name}” is a built-in preset: choose another name</source>
        <translation>“{name}”是内置预设：请换一个名称</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>{path} could not be read ({why}); it is kept as it is</source>
        <translation>无法读取 {path}（{why}）；文件保持原样</translation>
    </message>
    <message>
        <location line="+22"/>
        <source>“{name}” is built in: it cannot be deleted</source>
        <translation>“{name}”是内置预设：无法删除</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>{problem}, not overwritten: move it away to save presets again</source>
        <translation>{problem}，未覆盖该文件：请将其移走后再保存预设</translation>
    </message>
</context>
<context>
    <name>PullJob</name>
    <message>
        <location filename="../first_run.py" line="-223"/>
        <source>copying {name} ({size:.0f} MB) from the app into {folder}</source>
        <translation>正在从应用中复制 {name}（{size:.0f} MB）到 {folder}</translation>
    </message>
    <message>
        <location line="+25"/>
        <source>the warm-up failed ({why}); the first answer will compile its kernels</source>
        <translation>预热失败（{why}）；第一次回答时会编译内核</translation>
    </message>
</context>
<context>
    <name>ReplayBar</name>
    <message>
        <location filename="../inspector/replay.py" line="+28"/>
        <source>Live</source>
        <translation>实时</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>show the current token; off: replay the recorded ones</source>
        <translation>显示当前词元；关闭后回放已记录的词元</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>the token before</source>
        <translation>上一个词元</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>play: each token sweeps down the layers</source>
        <translation>播放：每个词元逐层向下扫过</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>the token after</source>
        <translation>下一个词元</translation>
    </message>
    <message>
        <location line="+6"/>
        <source> layers/s</source>
        <translation> 层/秒</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>how fast a token&apos;s routing sweeps down the Brain</source>
        <translation>词元的路由在“大脑”上向下扫过的速度</translation>
    </message>
    <message>
        <location line="+1"/>
        <location line="+117"/>
        <source>no routing recorded</source>
        <translation>未记录路由</translation>
    </message>
    <message>
        <location line="-4"/>
        <source>token {token} ({n} of {count}), {swept} of {layers} layers</source>
        <translation>词元 {token}（第 {n}/{count} 个），已扫过 {swept}/{layers} 层</translation>
    </message>
</context>
<context>
    <name>SettingsDialog</name>
    <message>
        <location filename="../settings_dialog.py" line="+106"/>
        <source>Settings</source>
        <translation>设置</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>where models are opened, converted and downloaded to (empty: Colibri&apos;s own folder)</source>
        <translation>打开、转换和下载模型所用的文件夹（留空：使用 Colibri 自己的文件夹）</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Browse…</source>
        <translation>浏览…</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>automatic</source>
        <translation>自动</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>compute threads of the engine (automatic: the physical cores, or --threads); used from the next model opened</source>
        <translation>引擎的计算线程数（自动：物理核心数，或 --threads 指定的值）；从下次打开模型起生效</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>Greedy (temperature 0)</source>
        <translation>贪婪（温度 0）</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Stop answers that repeat themselves</source>
        <translation>停止自我重复的回答</translation>
    </message>
    <message>
        <location line="+12"/>
        <source>the language of the window; System follows the system&apos;s language</source>
        <translation>窗口的语言；“跟随系统”使用系统的语言</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>The language changes when Colibri is next started.</source>
        <translation>语言将在下次启动 Colibri 时更改。</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>New chats start with this sampling; the chat&apos;s own fields change it for one chat.</source>
        <translation>新聊天使用这些采样设置；聊天界面中的设置只对当前聊天生效。</translation>
    </message>
    <message>
        <location line="+3"/>
        <location line="+50"/>
        <source>Models folder</source>
        <translation>模型文件夹</translation>
    </message>
    <message>
        <location line="-49"/>
        <source>Compute threads</source>
        <translation>计算线程</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Temperature</source>
        <translation>温度</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>Top-p</source>
        <translation>Top-p</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Repeat penalty</source>
        <translation>重复惩罚</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>Theme</source>
        <translation>主题</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Language</source>
        <translation>语言</translation>
    </message>
</context>
<context>
    <name>Shortcuts</name>
    <message>
        <location line="+54"/>
        <source>Send the question</source>
        <translation>发送问题</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Enter</source>
        <translation>回车</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>New line in the question</source>
        <translation>在问题中换行</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Shift+Enter</source>
        <translation>Shift+回车</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Stop the answer, or leave the question being edited</source>
        <translation>停止回答，或退出正在编辑的问题</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Escape</source>
        <translation>Esc</translation>
    </message>
</context>
<context>
    <name>ShortcutsDialog</name>
    <message>
        <location line="+9"/>
        <source>Keyboard shortcuts</source>
        <translation>键盘快捷键</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>Action</source>
        <translation>操作</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Keys</source>
        <translation>按键</translation>
    </message>
</context>
<context>
    <name>StoryPanel</name>
    <message>
        <location filename="../inspector/story.py" line="+21"/>
        <source>tier now: {tier}</source>
        <translation>当前层级：{tier}</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>not reported</source>
        <translation>未报告</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>no expert cache counters: its experts are not streamed</source>
        <translation>没有专家缓存计数：此模型的专家不是流式读取的</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>chosen by {n} of the layer&apos;s {steps} steps ({share})</source>
        <translation>在该层 {steps} 个步骤中被选中 {n} 次（{share}）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>served from memory {hits}, waited for disk {misses}</source>
        <translation>从内存提供 {hits} 次，等待磁盘 {misses} 次</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>reads from disk: {n}</source>
        <translation>磁盘读取：{n} 次</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>read ahead: {used} used, {wasted} wasted</source>
        <translation>预取：已用 {used}，浪费 {wasted}</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>tier changes at token (latest {shown} of {n}): {changes}</source>
        <translation>层级变化（词元：层级，{n} 次中的最近 {shown} 次）：{changes}</translation>
    </message>
    <message>
        <location line="+4"/>
        <source>tier changes at token: {changes}</source>
        <translation>层级变化（词元：层级）：{changes}</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>tier changes: none kept</source>
        <translation>层级变化：无记录</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>atlas: none yet (compute it in the Atlas tab)</source>
        <translation>图谱：暂无（可在“图谱”标签页中计算）</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>topic affinities: {topics}</source>
        <translation>话题亲和度：{topics}</translation>
    </message>
    <message>
        <location line="+17"/>
        <source>close the expert&apos;s story</source>
        <translation>关闭专家详情</translation>
    </message>
</context>
<context>
    <name>Theme</name>
    <message>
        <location filename="../theme.py" line="+71"/>
        <source>System</source>
        <translation>跟随系统</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Light</source>
        <translation>浅色</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Dark</source>
        <translation>深色</translation>
    </message>
</context>
<context>
    <name>Tiers</name>
    <message>
        <location filename="../inspector/common.py" line="-27"/>
        <source>no expert</source>
        <translation>无专家</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>disk</source>
        <translation>磁盘</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>cached</source>
        <translation>已缓存</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>pinned</source>
        <translation>固定</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>resident</source>
        <translation>常驻</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>unknown</source>
        <translation>未知</translation>
    </message>
</context>
<context>
    <name>TimeView</name>
    <message>
        <location filename="../inspector/timeline.py" line="+26"/>
        <source>attention</source>
        <translation>注意力</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>dense matmuls</source>
        <translation>稠密矩阵乘法</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>expert matmuls</source>
        <translation>专家矩阵乘法</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>I/O wait</source>
        <translation>I/O 等待</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>sampling</source>
        <translation>采样</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>other</source>
        <translation>其他</translation>
    </message>
    <message>
        <location line="+34"/>
        <source>ms per token</source>
        <translation>每词元毫秒数</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>recent records (oldest left)</source>
        <translation>最近的记录（最早的在左）</translation>
    </message>
    <message>
        <location line="+29"/>
        <location line="+53"/>
        <source>no decoded tokens yet</source>
        <translation>尚无解码词元</translation>
    </message>
    <message>
        <location line="-48"/>
        <source>Mean per decoded token</source>
        <translation>每个解码词元的平均耗时</translation>
    </message>
    <message>
        <location line="+44"/>
        <source>mean {time} per decoded token ({speed} tok/s); {n} records shown, triangles mark prompt chunks</source>
        <translation>每个解码词元平均 {time}（{speed} tok/s）；显示 {n} 条记录，三角形标记提示词分块</translation>
    </message>
    <message>
        <location line="+30"/>
        <source>; 1 bar cut at the top (arrow), {time}</source>
        <translation>；1 根柱子顶部被截断（箭头），{time}</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>; {n} bars cut at the top (arrows), the highest {time}</source>
        <translation>；{n} 根柱子顶部被截断（箭头），最高 {time}</translation>
    </message>
</context>
<context>
    <name>Transcript</name>
    <message>
        <location filename="../codeblocks.py" line="+201"/>
        <source>code</source>
        <translation>代码</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>copy the code to the clipboard</source>
        <translation>将代码复制到剪贴板</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>Copy</source>
        <translation>复制</translation>
    </message>
    <message>
        <location filename="../transcript.py" line="+53"/>
        <source>{n} tokens</source>
        <translation>{n} 个词元</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>stopped</source>
        <translation>已停止</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>max tokens reached</source>
        <translation>已达最大词元数</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>stopped: it repeated itself</source>
        <translation>已停止：回答在自我重复</translation>
    </message>
    <message>
        <location line="+315"/>
        <source>You</source>
        <translation>你</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Assistant</source>
        <translation>助手</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>System</source>
        <translation>系统</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>copy</source>
        <translation>复制</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>copy this message&apos;s text (Markdown)</source>
        <translation>复制这条消息的文本（Markdown）</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>edit</source>
        <translation>编辑</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>edit this question and send it again as a branch (the conversation after it is kept as a copy)</source>
        <translation>编辑这个问题并作为分支重新发送（其后的对话会保留一份副本）</translation>
    </message>
    <message>
        <location line="+3"/>
        <source>regenerate</source>
        <translation>重新生成</translation>
    </message>
    <message>
        <location line="+1"/>
        <source>write this answer again as a branch (the conversation from here is kept as a copy)</source>
        <translation>作为分支重新生成这条回答（从这里开始的对话会保留一份副本）</translation>
    </message>
    <message>
        <location line="+22"/>
        <source>Reasoning ({n} word)</source>
        <translation>推理过程（{n} 个词）</translation>
    </message>
    <message>
        <location line="+0"/>
        <source>Reasoning ({n} words)</source>
        <translation>推理过程（{n} 个词）</translation>
    </message>
</context>
<context>
    <name>_Legend</name>
    <message>
        <location filename="../inspector/atlas.py" line="-388"/>
        <source>size: probe selections (bigger = more evidence) · bright: routed by the current token · ring: selected expert · drag: turn, wheel: zoom, shift+drag: pan</source>
        <translation>大小：探针选中次数（越大 = 证据越多）· 高亮：当前词元路由到的专家 · 圆环：选中的专家 · 拖动：旋转，滚轮：缩放，Shift+拖动：平移</translation>
    </message>
    <message>
        <location line="+5"/>
        <source>hover an expert</source>
        <translation>将鼠标悬停在专家上</translation>
    </message>
    <message>
        <location line="+7"/>
        <source>Top topic</source>
        <translation>主要话题</translation>
    </message>
    <message>
        <location line="+19"/>
        <source>never chosen ({n})</source>
        <translation>从未被选中（{n}）</translation>
    </message>
    <message>
        <location line="+13"/>
        <source>axes: {names} of the spread between the experts&apos; topic mixes</source>
        <translation>坐标轴：{names}，即各轴在专家话题分布差异中所占的份额</translation>
    </message>
    <message>
        <location line="+2"/>
        <source>axes: {names} (this atlas does not record their shares of the spread: compute it again to see them)</source>
        <translation>坐标轴：{names}（这份图谱没有记录各轴所占的差异份额：重新计算图谱即可看到）</translation>
    </message>
</context>
</TS>
