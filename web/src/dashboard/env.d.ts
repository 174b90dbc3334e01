// The stylesheet is bundled by esbuild into dashboard.css.
declare module '*.css'
