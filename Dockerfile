# Hugging Face Space (Docker SDK) style: port 7860, uid 1000, caches on the persistent /data volume.
FROM python:3.11-slim
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH \
    ACCELDEMO_CACHE_DIR=/data/acceldemo GRADIO_ANALYTICS_ENABLED=False
WORKDIR /home/user/app
COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir --user -r requirements.txt
COPY --chown=user . .
EXPOSE 7860
CMD ["python", "app.py"]
